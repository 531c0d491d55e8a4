"""The order in which ``copy_engine`` hands operations to its lanes, and what it works out once.

The CPU emulation runs the real schedule; each lane is wrapped in a recorder that logs every
operation (then runs it), so the tests read the queue each lane was given: a Q/K/V copy never
waits behind an attention-output copy, every copy follows the one compute mark taken at its
``start``, the own block needs no flag or credit, and the views of every exchange are made in
``prepare`` rather than per call (the host cost per exchange that the GPU run exposed).
"""

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from test_ulysses import _qkv, world_transport

from ditrun.parallel.ulysses import UlyssesAttention
from ditrun.transport.base import gather_shape
from ditrun.transport.device import WaitLog


class RecordingLane:
    """A real lane whose operations are also logged as (exchange label, operation)."""

    def __init__(self, lane, log: list, label: list):
        self.lane, self.log, self.label = lane, log, label

    def __getattr__(self, name):
        attr = getattr(self.lane, name)
        if name not in ("follow", "wait_value", "copy", "write_value", "mark", "wait_marks"):
            return attr

        def logged(*args, **kwargs):
            self.log.append((self.label[0], name))
            return attr(*args, **kwargs)

        return logged


def _record_lanes(transport) -> tuple[dict, list]:
    """Wrap the transport's lanes; returns ({lane index or 'compute': log}, label cell set per start)."""
    label, logs = [None], {}
    for j, lane in enumerate(transport.lanes):
        if lane is not None:
            logs[j] = []
            transport.lanes[j] = RecordingLane(lane, logs[j], label)
    logs["compute"] = []
    transport.compute = RecordingLane(transport.compute, logs["compute"], label)
    original = transport.start

    def start(send, shape, head_group=0):
        label[0] = (shape.kind, head_group, transport.started.get((shape.kind, head_group), 0))
        return original(send, shape, head_group)

    transport.start = start
    return logs, label


def _ulysses_lane_logs(rank, world, layers):
    transport = world_transport("copy_engine")
    q, k, v = (t[:, 4 * rank : 4 * rank + 4] for t in _qkv([4] * world, heads=8))
    attention = UlyssesAttention(transport, [4] * world, head_groups=2)
    transport.prepare(attention.shapes(q))
    logs, _ = _record_lanes(transport)
    for _ in range(layers):
        attention(q, k, v)
    dist.barrier()
    return {lane: log for lane, log in logs.items()}


def _exchanges(log: list) -> list:
    """The exchange labels in the order a lane first saw them."""
    seen = []
    for label, _ in log:
        if label not in seen:
            seen.append(label)
    return seen


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_each_lane_gets_qkv_before_attention_out_and_one_compute_mark_per_exchange():
    layers = 3
    for rank, logs in enumerate(run_ranks(_ulysses_lane_logs, 2, (layers,))):
        peer = 1 - rank
        expected = [(kind, g, n) for n in range(layers) for kind in ("qkv", "attention_out") for g in (0, 1)]
        for lane in (rank, peer):
            # Head group 1's Q/K/V copy is queued before head group 0's output copy, which follows
            # that group's attention: it never waits behind it.
            assert _exchanges(logs[lane]) == expected
        for label in expected:
            peer_ops = [op for lbl, op in logs[peer] if lbl == label]
            own_ops = [op for lbl, op in logs[rank] if lbl == label]
            credit = ["wait_value"] if label[2] >= 2 else []  # the slot's previous tenant was released
            assert peer_ops == ["follow", *credit, "copy", "write_value", "mark"]
            assert own_ops == ["follow", "copy", "mark"]  # no flag, no credit: an event orders it
            compute = [op for lbl, op in logs["compute"] if lbl == label]
            assert compute.count("mark") == 1  # every lane follows the same mark of the compute stream


def _routes_after(rank, world, layers):
    transport = world_transport("copy_engine")
    q, k, v = (t[:, 4 * rank : 4 * rank + 4] for t in _qkv([4] * world, heads=8))
    attention = UlyssesAttention(transport, [4] * world, head_groups=2)
    transport.prepare(attention.shapes(q))
    prepared = dict(transport.routes)
    for _ in range(layers):
        attention(q, k, v)
    same_views = all(transport.routes[key] is route for key, route in prepared.items())
    return len(prepared), len(transport.routes), same_views


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_prepare_makes_every_view_the_exchanges_use():
    # 2 shapes x 2 head groups x 2 slots, all made in prepare; three layers later, no new one.
    assert run_ranks(_routes_after, 2, (3,)) == [(8, 8, True)] * 2


def _foreign_send(rank, world):
    transport = world_transport("copy_engine")
    shape = gather_shape("gather", [2] * world, (3,), torch.float32)
    transport.prepare([shape])
    got = []
    for n in range(3):  # past two slots: the credits of a caller's own tensor are waited for as well
        send = torch.full((2 * world, 3), float(10 * n + rank))  # not the transport's send slot
        handle = transport.start(send, shape)
        got.append(handle.wait()[::2, 0].tolist())
        handle.release()
    return got


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_send_tensor_of_the_callers_own_is_delivered():
    assert run_ranks(_foreign_send, 2) == [[[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]]] * 2


def test_the_wait_log_names_the_oldest_late_wait_and_drops_satisfied_ones():
    log = WaitLog(timeout_s=1.0)
    for index, value in [(0, 1), (1, 1), (0, 2)]:
        log.watch(index, value, f"wait {index}>={value}", now=0.0)
    assert log.check([1, 0], now=0.5) is None and len(log.pending) == 2  # the first is satisfied
    assert log.check([1, 0], now=2.0)[3] == "wait 1>=1"  # late: named, and dropped
    assert log.check([1, 1], now=2.0)[3] == "wait 0>=2"
    assert log.check([5, 5], now=9.0) is None and not log.pending


@pytest.mark.gpu
def test_a_peer_copy_is_one_raw_driver_memcpy_that_moves_the_bytes():
    from ditrun.transport.device import StreamOps, dma_copy

    ops, stream = StreamOps(), torch.cuda.Stream()
    src = torch.arange(4096, device="cuda", dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    stream.wait_stream(torch.cuda.current_stream())
    dma_copy(dst, src, stream, ops)
    stream.synchronize()
    assert ops.memcpy is not None  # the driver call was taken (and not given up on)
    assert torch.equal(dst, src)


@pytest.mark.gpu
@pytest.mark.timeout(30)
def test_the_watchdog_names_a_stream_wait_that_never_ends_and_frees_the_stream():
    from ditrun.transport.base import PeerLost
    from ditrun.transport.device import StreamLane, StreamOps, Watchdog

    device = torch.device("cuda", torch.cuda.current_device())
    flags = torch.zeros(4, dtype=torch.int32, device=device)
    # The zeros are written on the current stream; the lane's wait reads the flags from another. Unordered, it
    # can read the bytes an earlier test left in that memory, find the flag already set and never wait.
    torch.cuda.synchronize(device)
    ops = StreamOps()
    watchdog = Watchdog(device, ops, flags, timeout_s=0.5)
    lane = StreamLane(device, ops, watchdog, torch.cuda.Stream(device))
    try:
        lane.wait_value(flags, 2, 1, lambda timeout_s: f"no flag within {timeout_s:g} s")
        lane.stream.synchronize()  # returns once the watchdog has written the awaited value
    except PeerLost:  # without stream operations the host polls, and raises itself
        pass
    finally:
        watchdog.close()
    assert isinstance(watchdog.error, PeerLost) and "no flag within 0.5 s" in str(watchdog.error)
    assert flags[2].item() == 1


class CountingFlags(list):
    """Flags as read, counting how many the check looks at."""

    reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_a_wait_log_check_reads_only_the_satisfied_waits_and_one_more():
    # The watchdog checks while holding the interpreter lock that the thread issuing the GPU work
    # needs; with the host running ahead of the GPU, hundreds of waits are pending at once (the
    # first GPU run's watchdog read every pending wait and compared lists pairwise, every 5 ms).
    log = WaitLog(timeout_s=60.0)
    for n in range(1000):
        log.watch(n % 8, 1 + n // 8, "wait", now=0.0)
    seen = CountingFlags([2] * 8)  # the first 16 waits are satisfied
    assert log.check(seen, now=1.0) is None
    assert seen.reads == 17 and len(log.pending) == 1000 - 16
