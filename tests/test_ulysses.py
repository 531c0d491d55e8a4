"""Ulysses attention and the transport on real gloo ranks, against attention on one process."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from ranks import RankFailed, run_ranks
from test_sampler import _edit_inputs

from ditrun.config import TransportConfig
from ditrun.kernels.attention_payload import PAYLOADS
from ditrun.model.dit import sdpa_attention
from ditrun.parallel.ulysses import SequenceShards, UlyssesAttention, attention_shapes, even_splits
from ditrun.timers import ExposedTransfer
from ditrun.transport.base import ExchangeShape, LocalTransport, SentBytes, all_gather_rows, gather_shape
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
    transport.prepare(attention.shapes(q))
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
    for n in range(13):
        for parts in range(1, 6):
            splits = even_splits(n, parts)
            assert len(splits) == parts and sum(splits) == n
            larger = n - parts * (n // parts)  # the first n % parts ranks take one more
            assert splits == [n // parts + 1] * larger + [n // parts] * (parts - larger)
    shards = SequenceShards.split(text_len=7, output_len=6, reference_len=6, size=4, rank=3)
    assert shards.joint == [6, 6, 4, 3] and shards.output_slice() == slice(5, 6)
    slices = [SequenceShards.split(7, 10, 6, 4, rank).output_slice() for rank in range(4)]
    assert slices == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]


def test_each_rank_gets_its_slice_of_every_per_token_input():
    _, inputs = _edit_inputs(h=4, w=6)  # 6 output and 6 reference tokens, 5 of text: 7 here, each numbered
    prompt, neg_prompt = torch.randn(2, 1, 7, inputs.prompt.shape[-1]).unbind()
    txt_ids = torch.arange(21, dtype=torch.float32).view(7, 3)
    inputs = dataclasses.replace(
        inputs, prompt=prompt, neg_prompt=neg_prompt, txt_ids=txt_ids, ref_ids=inputs.ref_ids + 9
    )
    pieces = [SequenceShards.split(7, 6, 6, 4, rank).local_inputs(inputs) for rank in range(4)]
    for name in ("noise", "ref_latents", "prompt", "neg_prompt"):
        assert torch.equal(torch.cat([getattr(p, name) for p in pieces], dim=1), getattr(inputs, name)), name
    for name in ("img_ids", "ref_ids", "txt_ids"):
        assert torch.equal(torch.cat([getattr(p, name) for p in pieces]), getattr(inputs, name)), name
    assert [p.prompt.shape[1] for p in pieces] == [2, 2, 2, 1] and [p.noise.shape[1] for p in pieces] == [2, 2, 1, 1]
    assert torch.equal(pieces[1].pooled, inputs.pooled)  # not per token: whole on every rank
    no_negative = dataclasses.replace(inputs, neg_prompt=None)
    assert SequenceShards.split(7, 6, 6, 4, 1).local_inputs(no_negative).neg_prompt is None
    local = torch.randn(2, 3, 5)
    assert torch.equal(SequenceShards.split(7, 3, 6, 1, 0).gather_output(LocalTransport(), local), local)


def test_exchange_shapes_count_rows_and_bytes():
    """Ulysses over 3 ranks holding 5, 4 and 3 tokens, batch 2, 12 heads of 8 in 2 head groups, BF16."""
    qkv, out = attention_shapes([5, 4, 3], 2, 12, 8, 2, torch.bfloat16)
    per_rank = 12 // (3 * 2)  # each destination's heads of one group
    assert qkv.counts == ((5, 5, 5), (4, 4, 4), (3, 3, 3)) and out.counts == ((5, 4, 3),) * 3
    assert qkv.row_shape == (3, 2, per_rank, 8) and out.row_shape == (2, per_rank, 8)
    assert (qkv.row_bytes, out.row_bytes) == (3 * 2 * per_rank * 8 * 2, 2 * per_rank * 8 * 2)
    assert qkv.head_groups == out.head_groups == 2 and (qkv.kind, out.kind) == ("qkv", "attention_out")
    assert qkv.send_splits(1) == [4, 4, 4] and qkv.recv_splits(1) == [5, 4, 3] == out.send_splits(1)
    assert [qkv.landing_row(source, 2) for source in range(3)] == [0, 5, 9]
    assert (qkv.max_send_rows(), qkv.max_recv_rows(), out.max_send_rows(), out.max_recv_rows()) == (15, 12, 12, 15)
    skewed = ExchangeShape("x", ((1, 2, 0), (0, 0, 7), (3, 1, 1)), (4,), torch.float64)
    assert skewed.size == 3 and skewed.row_bytes == 32 and [skewed.landing_row(s, 2) for s in range(3)] == [0, 0, 7]
    assert (skewed.max_send_rows(), skewed.max_recv_rows()) == (7, 8) and skewed.recv_splits(0) == [1, 0, 3]
    gather = gather_shape("g", [2, 0, 1], [5, 3], torch.float32)
    assert gather.counts == ((2, 2, 2), (0, 0, 0), (1, 1, 1)) and gather.row_shape == (5, 3)
    assert gather.row_bytes == 60 and gather.head_groups == 1 and gather.dtype == torch.float32
    # With a payload, Q/K/V rows are its records and each rank's statistics (B x H x (D + 3) fp64) are gathered.
    payload = PAYLOADS.get("int8qk")("emulation")
    qkv, out, stats = attention_shapes([5, 4, 3], 2, 12, 8, 2, torch.bfloat16, payload)
    record = payload.layout(8, torch.bfloat16).nbytes
    assert qkv.row_shape == (2, per_rank, record) and qkv.dtype == torch.uint8 and qkv.counts[0] == (5, 5, 5)
    assert (qkv.kind, qkv.head_groups, stats.kind) == ("qkv", 2, "attention_statistics")
    assert all(type(n) is int for shape in (qkv, out, stats) for n in shape.row_shape)
    assert out.row_bytes == 2 * per_rank * 8 * 2
    assert stats.counts == ((1, 1, 1),) * 3 and stats.row_bytes == 2 * 12 * (8 + 3) * 8


def test_sent_bytes_count_what_leaves_the_rank():
    shape = ExchangeShape("qkv", ((1, 2, 3), (2, 2, 2), (0, 1, 0)), (4,), torch.float32)
    sent = SentBytes()
    sent.add(torch.zeros(6, 4), shape, 0)
    sent.add(torch.zeros(6, 4), shape, 0)
    sent.add(torch.zeros(6, 4), ExchangeShape("out", shape.counts, (4,), torch.float32), 1)
    assert sent.take() == {"qkv": 2 * (2 + 3) * 16, "out": (2 + 2) * 16} and sent.take() == {}


def test_all_gather_rows_of_one_rank_is_its_rows():
    rows = torch.randn(3, 2, 4, dtype=torch.float64)
    gathered = all_gather_rows(LocalTransport(), rows, [3], "g")
    assert torch.equal(gathered, rows) and gathered.dtype == torch.float64 and gathered.data_ptr() != rows.data_ptr()
    assert LocalTransport().sent.take() == {}  # nothing leaves an axis of one


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

    def start(self, send, shape, head_group=0):
        self.log.append(f"start {shape.kind} {head_group}")
        handle, log = self.inner.start(send, shape, head_group), self.log

        class Logged:
            def wait(self):
                log.append(f"wait {shape.kind} {head_group}")
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
