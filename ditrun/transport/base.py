"""The transport protocol: an all-to-all over one process-group axis, planned once, started, awaited.

A layout describes each exchange as an ``ExchangeShape``: the P x P matrix of row counts (row
``i`` = what rank ``i`` sends to each peer), the shape and dtype of one row, and how many head
groups may be in flight at once. Every rank holds the whole matrix, because a one-sided
transport must know where its rows land in each peer's buffer. The life of one exchange:

1. ``prepare(shapes)``, once per run shape, outside every timed region and on every rank of the
   axis at the same point (it may allocate and map buffers into the peers: a collective call);
2. ``send_buffer(shape, head_group)``: the tensor the producer writes its rows into (the
   transport's own send slot, so no extra copy is made), row-major along dim 0, the rows for
   peer ``j`` contiguous and in peer order;
3. ``start(send, shape, head_group)`` on the compute stream once those rows are written; it
   returns at once with a ``Handle``; ``send`` must not be written again (the transport reads
   it until its copies are done, and reuses a send slot only after that);
4. ``Handle.wait()`` makes the compute stream wait for every peer's rows and returns them
   (``sum(recv_splits)`` rows, peer ``j``'s block at row ``sum(counts[:j][rank])``);
5. ``Handle.release()`` once the last read of the received tensor is queued on the compute
   stream. The received tensor is valid until then and only until then: a one-sided
   transport hands its slot back to the senders at ``release``, and a sender waits for that
   credit before it writes the slot again (two slots per head group, so a sender can run one
   exchange ahead). Releases come in start order per (kind, head group), and exchange ``n``
   starts only once this rank released exchange ``n - 2``: at most two are held at a time.

Between ``start`` and ``wait`` the exchange runs on the transport's own streams (GPUs) or
threads (CPUs), so the caller can compute something else: that is how head groups overlap.
Every wait is timed through ``ExposedTransfer.timed`` so the run reports how long compute
really stalled, and every ``start`` adds the bytes it sends to its peers to the transport's ``sent``
(``SentBytes``), so a record reports what really moved rather than what shapes imply.
Splits may be uneven (a sequence that the group size does not divide), and 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

CPU = torch.device("cpu")


class PeerLost(RuntimeError):
    """A peer did not deliver (or hand back) a buffer within the transport's timeout: dead or stalled."""


@dataclass(frozen=True)
class ExchangeShape:
    """One all-to-all's geometry, the same on every rank of the axis."""

    kind: str
    """What is exchanged (``qkv``, ``attention_out``, ...): labels the timed wait and names the buffers."""
    counts: tuple[tuple[int, ...], ...]
    """``counts[i][j]``: rows that rank ``i`` sends to rank ``j``."""
    row_shape: tuple[int, ...]
    """The shape of one row (dims after dim 0)."""
    dtype: torch.dtype
    head_groups: int = 1
    """Exchanges of this kind that may be in flight at once (one per head group)."""

    @property
    def size(self) -> int:
        return len(self.counts)

    def send_splits(self, rank: int) -> list[int]:
        return list(self.counts[rank])

    def recv_splits(self, rank: int) -> list[int]:
        return [row[rank] for row in self.counts]

    def landing_row(self, source: int, dest: int) -> int:
        """Where ``source``'s rows start in ``dest``'s received tensor."""
        return sum(self.counts[i][dest] for i in range(source))

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()

    def max_recv_rows(self) -> int:
        """The most rows any rank receives (buffers are laid out alike on every rank)."""
        return max(sum(self.recv_splits(r)) for r in range(self.size))

    def max_send_rows(self) -> int:
        return max(sum(row) for row in self.counts)


def gather_shape(kind: str, sizes: Sequence[int], row_shape: Sequence[int], dtype: torch.dtype) -> ExchangeShape:
    """An all-gather as an all-to-all: rank ``i`` sends its ``sizes[i]`` rows to every rank."""
    return ExchangeShape(kind, tuple(tuple([n] * len(sizes)) for n in sizes), tuple(row_shape), dtype)


class SentBytes:
    """Bytes a rank's transport sent to its peers, per exchange kind, since the last ``take``. A rank's own
    rows do not leave it and are not counted."""

    def __init__(self):
        self.by_kind: dict[str, int] = {}

    def add(self, send: torch.Tensor, shape: ExchangeShape, rank: int) -> None:
        """Count one exchange's send rows ([sum(send_splits), *row]) bound for the other ranks."""
        blocks = send.split(shape.send_splits(rank))
        sent = sum(block.nbytes for peer, block in enumerate(blocks) if peer != rank)
        self.by_kind[shape.kind] = self.by_kind.get(shape.kind, 0) + sent

    def take(self) -> dict[str, int]:
        """The counts so far, starting again from zero."""
        taken, self.by_kind = self.by_kind, {}
        return taken


class Handle(Protocol):
    def wait(self) -> torch.Tensor:
        """Make the compute stream wait for the exchange; returns the received rows."""

    def release(self) -> None:
        """The received rows are read (as far as the compute stream is concerned): the slot may be reused."""


class Transport(Protocol):
    size: int
    """Ranks along the axis."""
    rank: int
    """This rank's index along the axis."""
    sent: SentBytes
    """What ``start`` sent to the peers so far (each transport counts its own)."""

    def prepare(self, shapes: Sequence[ExchangeShape]) -> None:
        """Size (and map) buffers for these shapes; collective, outside every timed region."""

    def send_buffer(self, shape: ExchangeShape, head_group: int = 0) -> torch.Tensor:
        """``[sum(send_splits), *row_shape]``: where the producer writes the rows to send."""

    def start(self, send: torch.Tensor, shape: ExchangeShape, head_group: int = 0) -> Handle:
        """Start the exchange; ``shape.kind`` and ``head_group`` label the timed wait."""


class Ready:
    """A handle whose data is already here (an axis of one rank: nothing moves, nothing waits)."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def wait(self) -> torch.Tensor:
        return self.data

    def release(self) -> None:
        self.data = None


def fresh_send_buffer(shape: ExchangeShape, rank: int, device: torch.device) -> torch.Tensor:
    """A newly allocated send buffer, for transports that own no send slots."""
    return torch.empty((sum(shape.send_splits(rank)), *shape.row_shape), dtype=shape.dtype, device=device)


class LocalTransport:
    """The transport of an axis of size 1: the received rows are the sent rows."""

    size = 1
    rank = 0

    def __init__(self, device: torch.device = CPU):
        self.device = device
        self.sent = SentBytes()  # stays empty: nothing leaves an axis of one

    def prepare(self, shapes) -> None:
        pass

    def send_buffer(self, shape: ExchangeShape, head_group: int = 0) -> torch.Tensor:
        return fresh_send_buffer(shape, 0, self.device)

    def start(self, send, shape, head_group=0) -> Handle:
        return Ready(send)


def all_gather_rows(transport: Transport, rows: torch.Tensor, sizes: Sequence[int], kind: str) -> torch.Tensor:
    """Every rank's ``rows`` (``sizes[j]`` of them on rank ``j``), concatenated in rank order.

    rows: [sizes[rank], ...] -> [sum(sizes), ...], a tensor of the caller's own (the received
    slot is copied out and released at once). An all-to-all in which each rank sends the same
    rows to every peer, so that it runs on any transport.
    """
    shape = gather_shape(kind, sizes, rows.shape[1:], rows.dtype)
    send = transport.send_buffer(shape)
    send.view(transport.size, *rows.shape).copy_(rows.unsqueeze(0).expand(transport.size, *rows.shape))
    handle = transport.start(send, shape)
    gathered = handle.wait().clone()
    handle.release()
    return gathered
