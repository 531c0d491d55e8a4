"""The ``copy_engine`` transport: an all-to-all made of one-sided copies into peers' receive slots.

Every rank of an SP group maps one region into every peer once (``prepare``), laid out alike on
all ranks (``SlotLayout``): a flag area, then, per exchange kind and head group, two receive
slots sized for the largest shape of the run. Exchange ``n`` of a (kind, head group) uses slot
``n % 2``. To send, rank ``i``, on the lane (stream or thread) of each peer ``j``:

1. waits for ``j``'s credit for the slot (``j`` has released exchange ``n - 2``), unless ``n < 2``;
2. copies its rows for ``j`` — one contiguous block, so one memcpy — to where they land in
   ``j``'s slot (the shape's row-count matrix says where);
3. raises the epoch flag ``data[kind, group, i]`` in ``j``'s region to ``n + 1``.

The receiver's compute lane waits until every peer's epoch flag reaches ``n + 1`` (``wait``),
reads the slot, and on ``release`` writes its credit ``n + 1`` into every sender's region.
Epochs only grow, so a flag is never reset and a late reader cannot mistake an old one.
Each rank's own block is copied by a lane of its own, which the compute lane waits for by its
mark (an event), with no flag and no credit: ``start`` of exchange ``n`` requires that this rank
released exchange ``n - 2`` (checked), and the lane follows the compute stream. Every wait has
the transport's timeout: a peer that died or hangs is named, never waited on forever.

Peers on another node (the placement's nodes, ``parallel/placement.py``, or blocks of
``transport.node_size`` ranks) have no mapping: their rows go through the process group's
collective (``all_to_all`` with empty blocks for the local peers), straight into the same slot;
the receiver's own ``start`` is their credit.

Everything an exchange needs that does not change from one exchange to the next (views of the
send slot per peer, where they land, flag indices) is worked out once per shape in ``prepare``
(``Route``): the host's cost per exchange is on the critical path of a head-group pipeline.

Backends: CPU = shared-memory files + ``ThreadLane`` per peer (CI runs the real schedule);
CUDA/ROCm = ``torch.distributed._symmetric_memory`` + ``StreamLane`` per peer (``device.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ditrun.timers import ExposedTransfer
from ditrun.transport.base import ExchangeShape, SentBytes
from ditrun.transport.lanes import raise_lane_error

ALIGN = 256
"""Bytes every slot is aligned to (a GPU copy engine's preferred alignment; plenty for a CPU)."""
FLAG_BYTES = 4
"""Flags are 32-bit: what a GPU stream write-value / wait-value operation reads and writes."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Where each flag and slot sits in a region; the same on every rank of the group."""

    size: int
    kinds: tuple[str, ...]
    head_groups: tuple[int, ...]
    """Per kind: head groups in flight at once."""
    recv_bytes: tuple[int, ...]
    """Per kind: bytes of one receive slot."""
    send_bytes: tuple[int, ...]
    """Per kind: bytes of one send slot (local memory, not mapped)."""

    @classmethod
    def for_shapes(cls, shapes: Sequence[ExchangeShape]) -> "SlotLayout":
        kinds = tuple(sorted({p.kind for p in shapes}))
        of = {k: [p for p in shapes if p.kind == k] for k in kinds}
        return cls(
            shapes[0].size,
            kinds,
            tuple(max(p.head_groups for p in of[k]) for k in kinds),
            tuple(_aligned(max(p.max_recv_rows() * p.row_bytes for p in of[k])) for k in kinds),
            tuple(_aligned(max(p.max_send_rows() * p.row_bytes for p in of[k])) for k in kinds),
        )

    def fits(self, shapes: Sequence[ExchangeShape]) -> bool:
        """Whether every shape has a slot here large enough (then nothing is remapped)."""
        for p in shapes:
            if p.kind not in self.kinds:
                return False
            k = self.kinds.index(p.kind)
            if (
                p.head_groups > self.head_groups[k]
                or p.max_recv_rows() * p.row_bytes > self.recv_bytes[k]
                or p.max_send_rows() * p.row_bytes > self.send_bytes[k]
            ):
                return False
        return True

    def merged(self, shapes: Sequence[ExchangeShape]) -> "SlotLayout":
        """A layout for these shapes and every slot this one had, each the larger of the two."""
        mine = SlotLayout.for_shapes(shapes)
        kinds = tuple(sorted(set(self.kinds) | set(mine.kinds)))

        def biggest(field: str, kind: str) -> int:
            return max(
                getattr(layout, field)[layout.kinds.index(kind)] for layout in (self, mine) if kind in layout.kinds
            )

        return SlotLayout(
            self.size,
            kinds,
            *(tuple(biggest(f, k) for k in kinds) for f in ("head_groups", "recv_bytes", "send_bytes")),
        )

    def _lane_index(self, kind: str, head_group: int) -> int:
        k = self.kinds.index(kind)
        return sum(self.head_groups[:k]) + head_group

    @property
    def n_flags(self) -> int:
        """Two flags (epoch, credit) per (kind, head group, peer)."""
        return 2 * sum(self.head_groups) * self.size

    def data_flag(self, kind: str, head_group: int, source: int) -> int:
        """Index of the epoch flag that ``source`` raises in a receiver's region."""
        return self._lane_index(kind, head_group) * self.size + source

    def credit_flag(self, kind: str, head_group: int, receiver: int) -> int:
        """Index of the credit flag that ``receiver`` raises in a sender's region."""
        return self.n_flags // 2 + self.data_flag(kind, head_group, receiver)

    def slot_offset(self, kind: str, head_group: int, slot: int) -> int:
        """Byte offset of a receive slot."""
        offset = _aligned(self.n_flags * FLAG_BYTES)
        k = self.kinds.index(kind)
        for j in range(k):
            offset += 2 * self.head_groups[j] * self.recv_bytes[j]
        return offset + (2 * head_group + slot) * self.recv_bytes[k]

    @property
    def total_bytes(self) -> int:
        return self.slot_offset(self.kinds[-1], self.head_groups[-1], 0)


def typed(region: torch.Tensor, offset: int, shape: ExchangeShape, rows: int) -> torch.Tensor:
    """``rows`` rows of ``shape`` at byte ``offset`` of a byte tensor: [rows, *row_shape]."""
    nbytes = rows * shape.row_bytes
    return region[offset : offset + nbytes].view(shape.dtype).view(rows, *shape.row_shape)


def peers_on_this_node(ranks: Sequence[int], nodes: Sequence[str], node_size: int) -> list[bool]:
    """Per global rank in ``ranks``: whether it shares this rank's node, as the placement found it
    (``nodes``: every global rank's node; empty means one node), or, with ``node_size`` > 0,
    whether it falls in this rank's block of ``node_size`` consecutive global ranks."""
    me = dist.get_rank()
    if node_size > 0:
        return [r // node_size == me // node_size for r in ranks]
    if not nodes:
        return [True] * len(ranks)
    return [nodes[r] == nodes[me] for r in ranks]


class StagedAllToAll:
    """``all_to_all`` into scattered blocks for gloo, whose ``all_to_all`` needs blocks of one size:
    ``all_to_all_single`` through contiguous staging buffers, then each block copied into place."""

    def __init__(self, outputs: list, inputs: list, group):
        self.outputs = outputs
        self.staged = torch.empty((sum(o.shape[0] for o in outputs), *outputs[0].shape[1:]), dtype=outputs[0].dtype)
        self.work = dist.all_to_all_single(
            self.staged,
            torch.cat(inputs),
            [o.shape[0] for o in outputs],
            [i.shape[0] for i in inputs],
            group=group,
            async_op=True,
        )

    def wait(self) -> None:
        self.work.wait()
        for out, block in zip(self.outputs, self.staged.split([o.shape[0] for o in self.outputs])):
            out.copy_(block)


@dataclass(frozen=True, eq=False)  # identity, never compared: it holds tensors
class Route:
    """One (shape, head group, slot) worked out once, in ``prepare``: the views and flags ``start`` issues.

    An exchange then costs the host one dictionary lookup and, per peer, the lane operations
    themselves (no slicing, no byte offsets, no tensor views made per call).
    """

    send: torch.Tensor
    """The send slot's rows, [sum(send_splits), *row]: what ``send_buffer`` hands the producer."""
    sources: tuple
    """Per peer: its rows in ``send`` (a view; None for a peer on another node)."""
    targets: tuple
    """Per peer: where those rows land in its slot (a view into its mapped region; None off-node)."""
    recv: torch.Tensor
    """This rank's received rows in its own slot, [sum(recv_splits), *row]."""
    data_flag: int
    """Index of this rank's epoch flag in every receiver's region."""
    credit_flag: int
    """Index of this rank's credit flag in every sender's region."""
    data_flags: tuple
    """Per peer: the index of its epoch flag in this rank's region (what ``wait`` waits on)."""
    credit_flags: tuple
    """Per peer: the index of its credit flag in this rank's region (what a copy into it waits on)."""
    peers: tuple
    """The local peers other than this rank, which copies reach and flags order."""


class CopyEngineHandle:
    def __init__(
        self,
        transport: "CopyEngineTransport",
        shape: ExchangeShape,
        head_group: int,
        epoch: int,
        route: Route,
        own_copy,
        work,
    ):
        self.transport, self.shape, self.head_group, self.epoch = transport, shape, head_group, epoch
        self.route, self.own_copy, self.work = route, own_copy, work

    def wait(self) -> torch.Tensor:
        with self.transport.timer.timed(self.shape.kind, self.head_group):
            return self.transport._receive(self)

    def release(self) -> None:
        self.transport._release(self)


class CopyEngineTransport:
    """All-to-all over ``group`` by one-sided copies (module docstring); ``prepare`` before use."""

    def __init__(
        self,
        group,
        timer: ExposedTransfer,
        device: torch.device,
        timeout_s: float,
        chaos_s: float = 0.0,
        node_size: int = 0,
        nodes: Sequence[str] = (),
    ):
        self.group, self.timer, self.device, self.timeout_s = group, timer, device, timeout_s
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.local = peers_on_this_node(self.ranks, nodes, node_size)
        self.chaos_s = chaos_s
        self.sent = SentBytes()
        self.fabric = _fabric(device, timeout_s)
        self.layout: Optional[SlotLayout] = None
        self.lanes: list = []
        self.compute = None
        self.fitting: set = set()
        """The shapes checked against the layout (each once)."""

    # -- buffers --------------------------------------------------------------------------------

    def prepare(self, shapes: Sequence[ExchangeShape]) -> None:
        if not shapes:
            return
        if self.layout is None or not self.layout.fits(shapes):
            self._map(shapes)
        for shape in shapes:  # every view and flag index of the run, before the timed region
            for head_group in range(shape.head_groups):
                for slot in range(2):
                    self._route(shape, head_group, slot)

    def _map(self, shapes: Sequence[ExchangeShape]) -> None:
        self._drain()
        layout = SlotLayout.for_shapes(shapes) if self.layout is None else self.layout.merged(shapes)
        self.region = self.fabric.map(layout.total_bytes, self.group, self.local, layout.n_flags)
        self.send_slots = {
            (kind, g, s): torch.empty(layout.send_bytes[k], dtype=torch.uint8, device=self.device)
            for k, kind in enumerate(layout.kinds)
            for g in range(layout.head_groups[k])
            for s in range(2)
        }
        self.started: dict = {}
        self.released: dict = {}
        self.sent_marks: dict = {}
        self.routes: dict = {}
        self.fitting: set = set()
        self.layout = layout
        self._open_lanes()

    def _open_lanes(self) -> None:
        self.lanes = [
            self.fabric.peer_lane(
                f"copy-engine-{self.ranks[self.rank]}->{self.ranks[j]}",
                self.chaos_s,
                seed=self.ranks[self.rank] * 1000 + j,
            )
            if self.local[j]
            else None
            for j in range(self.size)
        ]
        self.compute = self.fabric.compute_lane(self.lanes)

    def _drain(self) -> None:
        """Let every copy finish and stop the lanes (before a region is replaced)."""
        if self.layout is None:
            return
        self.fabric.drain(self.lanes)
        self.lanes = []

    def close(self) -> None:
        self._drain()

    def _route(self, shape: ExchangeShape, head_group: int, slot: int) -> Route:
        route = self.routes.get((shape, head_group, slot))
        if route is None:
            self._key(shape, head_group)
            route = self.routes[(shape, head_group, slot)] = self._make_route(shape, head_group, slot)
        return route

    def _make_route(self, shape: ExchangeShape, head_group: int, slot: int) -> Route:
        offset = self.layout.slot_offset(shape.kind, head_group, slot)
        send = typed(self.send_slots[(shape.kind, head_group, slot)], 0, shape, sum(shape.send_splits(self.rank)))
        sources = self._split_send(send, shape)
        targets = tuple(
            typed(self.region.bytes(j), offset + shape.landing_row(self.rank, j) * shape.row_bytes, shape, rows)
            if self.local[j]
            else None
            for j, rows in enumerate(shape.send_splits(self.rank))
        )
        recv = typed(self.region.bytes(self.rank), offset, shape, sum(shape.recv_splits(self.rank)))
        peers = tuple(j for j in range(self.size) if self.local[j] and j != self.rank)
        flag, credit = (
            functools.partial(f, shape.kind, head_group) for f in (self.layout.data_flag, self.layout.credit_flag)
        )
        return Route(
            send,
            sources,
            targets,
            recv,
            flag(self.rank),
            credit(self.rank),
            tuple(flag(j) for j in range(self.size)),
            tuple(credit(j) for j in range(self.size)),
            peers,
        )

    def _split_send(self, send: torch.Tensor, shape: ExchangeShape) -> tuple:
        """Each local peer's rows of ``send`` (contiguous: one memcpy each), None for the others."""
        blocks = send.split(shape.send_splits(self.rank))
        return tuple(block if self.local[j] else None for j, block in enumerate(blocks))

    def send_buffer(self, shape: ExchangeShape, head_group: int = 0) -> torch.Tensor:
        """The send slot of the next exchange, once the copies out of its previous use are done."""
        key = self._key(shape, head_group)
        slot = self.started.get(key, 0) % 2
        marks = self.sent_marks.pop((shape.kind, head_group, slot), None)
        if marks:
            self.compute.wait_marks(marks, self.lanes)
        return self._route(shape, head_group, slot).send

    def _key(self, shape: ExchangeShape, head_group: int) -> tuple[str, int]:
        if shape not in self.fitting:  # checked once per shape: exchanges after the first cost a set lookup
            if self.layout is None or not self.layout.fits([shape]):
                raise RuntimeError(
                    f"copy_engine: the {shape.kind!r} exchange was not prepared (call prepare() with "
                    "every shape of the run before the timed region)."
                )
            self.fitting.add(shape)
        if not 0 <= head_group < shape.head_groups:
            raise RuntimeError(f"copy_engine: head group {head_group} of a shape with {shape.head_groups}.")
        return shape.kind, head_group

    # -- one exchange ---------------------------------------------------------------------------

    def start(self, send: torch.Tensor, shape: ExchangeShape, head_group: int = 0) -> CopyEngineHandle:
        # send: [sum(send_splits), *row], contiguous; peer j's rows land at landing_row(rank, j) in j's slot
        key = self._key(shape, head_group)
        raise_lane_error(self.lanes)
        epoch = self.started.get(key, 0)
        if self.released.get(key, 0) < epoch - 1:
            raise RuntimeError(
                f"copy_engine: exchange {epoch} of {shape.kind!r} started before exchange "
                f"{epoch - 2}, the last one in its slot, was released."
            )
        route = self._route(shape, head_group, epoch % 2)
        sources = route.sources if send.data_ptr() == route.send.data_ptr() else self._foreign(send, shape)
        self.sent.add(send, shape, self.rank)
        self.started[key] = epoch + 1
        # One mark of the compute stream, taken after the rows were written, which every lane follows:
        # a copy waits for its rows and for nothing the compute stream is given later.
        ready = self.compute.mark()
        own = self._copy_own(route, sources[self.rank], ready)
        marks = [self._send_to(j, sources[j], route, shape, head_group, epoch, ready) for j in route.peers]
        self.sent_marks[(*key, epoch % 2)] = marks + [own]
        return CopyEngineHandle(self, shape, head_group, epoch, route, own, self._start_remote(send, shape, route))

    def _foreign(self, send: torch.Tensor, shape: ExchangeShape) -> tuple:
        """The peers' blocks of a send tensor that is not this transport's send slot (kept alive by the lanes)."""
        if not send.is_contiguous():
            raise RuntimeError("copy_engine: the send buffer must be contiguous (one memcpy per peer).")
        for lane in self.lanes:
            if lane is not None:
                lane.hold(send)
        return self._split_send(send, shape)

    def _copy_own(self, route: Route, rows: torch.Tensor, ready):
        # The own block needs neither credit nor flag: its lane follows the compute stream, on which
        # exchange epoch - 2 was released before this start (checked), and the compute stream waits
        # for its mark (an event, a dependency the GPU scheduler sees: a stream waiting on a flag
        # that a stream of the same process writes could be queued ahead of that writer).
        lane = self.lanes[self.rank]
        lane.follow(ready)
        if rows.shape[0]:
            lane.copy(route.targets[self.rank], rows)
        return lane.mark()

    def _send_to(
        self, j: int, rows: torch.Tensor, route: Route, shape: ExchangeShape, head_group: int, epoch: int, ready
    ):
        lane = self.lanes[j]
        lane.follow(ready)
        if epoch >= 2:  # j released exchange epoch - 2, the slot's previous tenant
            lane.wait_value(
                self.region.flags(self.rank),
                route.credit_flags[j],
                epoch - 1,
                self._describe("free slot (credit)", shape, head_group, j),
            )
        if rows.shape[0]:
            lane.copy(route.targets[j], rows)
        lane.write_value(self.region.flags(j), route.data_flag, epoch + 1)
        return lane.mark()

    def _start_remote(self, send: torch.Tensor, shape: ExchangeShape, route: Route):
        """The collective for the peers on other nodes (None when every peer is on this node)."""
        if all(self.local):
            return None
        outputs = list(route.recv.split(shape.recv_splits(self.rank)))
        inputs = list(send.split(shape.send_splits(self.rank)))
        for j in range(self.size):  # local peers' blocks move by copies: empty in the collective
            if self.local[j]:
                outputs[j], inputs[j] = outputs[j][:0], inputs[j][:0]
        if dist.get_backend(self.group) == "gloo":
            return StagedAllToAll(outputs, inputs, self.group)
        return dist.all_to_all(outputs, inputs, group=self.group, async_op=True)

    def _receive(self, handle: CopyEngineHandle) -> torch.Tensor:
        # -> [sum(recv_splits), *row]: the slot, valid until release()
        self.compute.wait_marks([handle.own_copy], self.lanes)
        route, epoch = handle.route, handle.epoch
        for j in route.peers:
            self.compute.wait_value(
                self.region.flags(self.rank),
                route.data_flags[j],
                epoch + 1,
                self._describe(f"rows of exchange {epoch}", handle.shape, handle.head_group, j),
            )
        if handle.work is not None:
            handle.work.wait()
        raise_lane_error(self.lanes)
        return route.recv

    def _release(self, handle: CopyEngineHandle) -> None:
        key, epoch = (handle.shape.kind, handle.head_group), handle.epoch
        if self.released.get(key, 0) != epoch:
            raise RuntimeError(
                f"copy_engine: {key[0]!r} exchanges must be released in order "
                f"(released {self.released.get(key, 0)}, releasing {epoch})."
            )
        self.released[key] = epoch + 1
        for j in handle.route.peers:
            self.compute.write_value(self.region.flags(j), handle.route.credit_flag, epoch + 1)

    def _describe(self, what: str, shape: ExchangeShape, head_group: int, peer: int):
        me, them = self.ranks[self.rank], self.ranks[peer]
        return lambda timeout_s: (
            f"copy_engine: rank {me} got no {what} for its {shape.kind} exchange (head group "
            f"{head_group}) from rank {them} within {timeout_s:g} s; rank {them} is dead or "
            "stalled."
        )


def _fabric(device: torch.device, timeout_s: float):
    """What maps regions and makes lanes: GPU memory and streams, or shared memory and threads."""
    if device.type == "cuda":
        from ditrun.transport.device import SymmetricMemoryFabric

        return SymmetricMemoryFabric(device, timeout_s)
    from ditrun.transport.shared_memory import SharedMemoryFabric

    return SharedMemoryFabric(timeout_s)
