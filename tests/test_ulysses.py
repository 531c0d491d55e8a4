"""Ulysses attention and the transport on real gloo ranks, against attention on one process."""

import pytest
import torch
import torch.distributed as dist
from ranks import RankFailed, run_ranks

from ditrun.config import TransportConfig
from ditrun.model.dit import sdpa_attention
from ditrun.parallel.ulysses import SequenceShards, UlyssesAttention, even_splits
from ditrun.timers import ExposedTransfer
from ditrun.transport.base import LocalTransport, all_gather_rows
from ditrun.transport.registry import make_transport


def _qkv(lengths, heads=6, dim=8, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, sum(lengths), heads, dim, generator=gen) for _ in range(3)]


def world_transport(name: str = "collective", timer=None, **keys):
    """The transport ``name`` over every rank of the test, on the CPU."""
    timer = timer or ExposedTransfer(torch.device("cpu"))
    return make_transport(TransportConfig(name=name, **keys), dist.group.WORLD, timer, torch.device("cpu"), 20.0)


def _sharded_attention(rank, world, lengths, head_groups, name="collective"):
    timer = ExposedTransfer(torch.device("cpu"))
    transport = world_transport(name, timer)
    start = sum(lengths[:rank])
    q, k, v = (t[:, start : start + lengths[rank]] for t in _qkv(lengths))
    attention = UlyssesAttention(transport, lengths, head_groups)
    transport.prepare(attention.plans(q))
    out = attention(q, k, v)
    waits = timer.take()
    return out, sorted(waits["by_kind"]), sorted(waits["by_group"])


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["collective", "copy_engine"])
@pytest.mark.parametrize("lengths, head_groups", [([5, 4], 1), ([5, 4], 3), ([4, 3, 3], 2), ([3, 0, 2], 1)])
def test_ulysses_attention_equals_full_attention(lengths, head_groups, transport):
    """Uneven (even empty) shards, head groups pipelined: the gathered output is one process's attention."""
    outs = run_ranks(_sharded_attention, len(lengths), (lengths, head_groups, transport))
    q, k, v = _qkv(lengths)
    expected = sdpa_attention(q, k, v)
    got = torch.cat([out for out, _, _ in outs], dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for _, kinds, groups in outs:  # every wait was timed, per kind and per head group
        assert kinds == ["attention_out", "qkv"] and groups == list(range(head_groups))


def _gather(rank, world, sizes):
    transport = world_transport()
    rows = torch.full((sizes[rank], 3), float(rank))
    return all_gather_rows(transport, rows, sizes, "gather")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_all_gather_rows_with_uneven_sizes():
    outs = run_ranks(_gather, 3, ([2, 0, 1],))
    expected = torch.tensor([0.0, 0.0, 2.0])[:, None].expand(3, 3)
    for out in outs:
        assert torch.equal(out, expected)


def test_one_rank_needs_no_exchange():
    q, k, v = _qkv([7])
    transport = LocalTransport()
    for groups in (1, 2, 3):
        torch.testing.assert_close(UlyssesAttention(transport, [7], groups)(q, k, v), sdpa_attention(q, k, v))


def test_even_splits_and_shards():
    assert even_splits(7, 3) == [3, 2, 2] and even_splits(2, 4) == [1, 1, 0, 0]
    shards = SequenceShards.split(text_len=7, output_len=6, reference_len=6, size=4, rank=3)
    assert shards.joint == [6, 6, 4, 3] and shards.output_slice() == slice(5, 6)


def _raises(rank, world):
    if rank == 1:
        raise ValueError("rank 1 broke")
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_rank_harness_reports_a_failing_rank():
    with pytest.raises(RankFailed, match="rank 1 broke"):
        run_ranks(_raises, 2, timeout=40, collective_timeout=5)


class _LoggedTransport:
    """The real transport, with each start and wait written to a log in the order they happen."""

    def __init__(self, inner, log):
        self.inner, self.log, self.size, self.rank = inner, log, inner.size, inner.rank
        self.prepare, self.send_buffer = inner.prepare, inner.send_buffer

    def start(self, send, plan, head_group=0):
        self.log.append(f"start {plan.kind} {head_group}")
        handle, log = self.inner.start(send, plan, head_group), self.log

        class Logged:
            def wait(self):
                log.append(f"wait {plan.kind} {head_group}")
                return handle.wait()

            def release(self):
                handle.release()

        return Logged()


def _pipeline_order(rank, world):
    log = []
    transport = _LoggedTransport(world_transport(), log)
    q, k, v = (t[:, 3 * rank : 3 * rank + 3] for t in _qkv([3, 3], heads=6))
    UlyssesAttention(transport, [3, 3], head_groups=3)(q, k, v)
    return log


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_head_groups_overlap_exchange_with_attention():
    """Group g+1's exchange starts before group g is awaited; each output is sent back before the next wait."""
    expected = [
        "start qkv 0",
        "start qkv 1",
        "wait qkv 0",
        "start attention_out 0",
        "start qkv 2",
        "wait qkv 1",
        "start attention_out 1",
        "wait qkv 2",
        "start attention_out 2",
        "wait attention_out 0",
        "wait attention_out 1",
        "wait attention_out 2",
    ]
    assert run_ranks(_pipeline_order, 2) == [expected, expected]
