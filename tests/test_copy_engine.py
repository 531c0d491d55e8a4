"""``transport=copy_engine`` on forked gloo ranks: the CPU emulation runs the real schedule (slots,
epochs, credits, one thread per peer), and must give bitwise the latents of ``transport=collective``.

Both transports run in the same forked job, one after the other through the real worker, so a
test pays for one set of ranks; the workload is ``launching.TINY`` (a 19-token joint sequence
that neither 2 nor 4 divides) with 16 heads, so that 4 ranks with 4 head groups is valid.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from launching import latents, records, tiny_config
from ranks import run_ranks
from test_ulysses import _qkv, world_transport

from ditrun.parallel.ulysses import UlyssesAttention
from ditrun.run import worker
from ditrun.transport.base import ExchangeShape, PeerLost, gather_shape
from ditrun.transport.copy_engine import SlotLayout

# One double and one single block, three steps: every kind of exchange (Q/K/V and attention
# outputs per head group: 2 to 4 a step; the velocity gather and the CFG swap: 1 a step) runs at
# least 3 times, so each reuses a slot and waits for its credit.
FAST = [
    "model.num_attention_heads=16",
    "model.num_layers=1",
    "model.num_single_layers=1",
    "workload.steps=3",
    "metrics.ssim=false",
    "metrics.report=false",
]


@pytest.fixture(scope="module", autouse=True)
def _warm_parent(tmp_path_factory):
    """One run in the test process first: what it imports and loads lazily (workload images, metrics,
    writers) is then inherited by every forked rank instead of being loaded again in each."""
    worker.run(tiny_config(*FAST), tmp_path_factory.mktemp("warm"))


def _both_transports(rank, world, configs, out_dirs):
    for cfg, out in zip(configs, out_dirs):
        worker.run(cfg, out)


def assert_bitwise_equal(tmp_path, world: int, *overrides: str) -> None:
    """``overrides`` under transport=collective and transport=copy_engine give the same bits."""
    configs = [
        tiny_config(*FAST, f"launcher.world={world}", *overrides, f"transport={name}")
        for name in ("collective", "copy_engine")
    ]
    compare_transports(tmp_path, world, configs)


def compare_transports(tmp_path, world: int, configs, backend: str = "gloo") -> None:
    """Run both configs on the same ranks; the copy-engine run's latents are the collective run's, bit for bit."""
    out_dirs = [tmp_path / "collective", tmp_path / "copy_engine"]
    run_ranks(_both_transports, world, (configs, out_dirs), timeout=240, backend=backend)
    [expected], [found] = records(out_dirs[0]), records(out_dirs[1])
    assert found["transport"] == "copy_engine" and found["exposed_transfer_s"] > 0
    assert torch.equal(latents(out_dirs[1], found["edit"]), latents(out_dirs[0], expected["edit"]))


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["ulysses", "cfg_batch", "cfg_split"])
@pytest.mark.parametrize("head_groups", [1, 2, 4])
def test_copy_engine_equals_collective(tmp_path, world, layout, head_groups):
    assert_bitwise_equal(tmp_path, world, f"layout={layout}", f"layout.head_groups={head_groups}")


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout, world", [("ulysses", 4), ("cfg_split", 4), ("cfg_batch", 2)])
def test_copy_engine_with_chaos_delays(tmp_path, layout, world):
    """Random delays before every copy: epochs and credits still order every slot's reuse."""
    assert_bitwise_equal(tmp_path, world, f"layout={layout}", "layout.head_groups=2", "testing.chaos_s=0.003")


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("node_size", [1, 2])
def test_peers_on_other_nodes_go_through_the_collective(tmp_path, node_size):
    """Nodes of 1 rank (every peer remote) and of 2 (mixed: copies and the collective in one exchange)."""
    assert_bitwise_equal(tmp_path, 4, "layout=ulysses", "layout.head_groups=2", f"transport.node_size={node_size}")


def _attention_until_killed(rank, world, victim, rounds):
    """Ulysses attention again and again; the victim kills itself after starting an exchange."""
    transport = world_transport("copy_engine", timeout_s=3.0)
    q, k, v = (t[:, 4 * rank : 4 * rank + 4] for t in _qkv([4] * world, heads=8))
    attention = UlyssesAttention(transport, [4] * world, head_groups=2)
    transport.prepare(attention.shapes(q))
    if rank == victim:
        original = transport.start

        def start_then_die(*args, **kwargs):
            handle = original(*args, **kwargs)
            if transport.started[("qkv", 0)] == rounds:
                os.kill(os.getpid(), signal.SIGKILL)
            return handle

        transport.start = start_then_die
    try:
        for _ in range(2 * rounds):
            attention(q, k, v)
    except PeerLost as err:
        return str(err)
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_a_killed_peer_is_named_within_the_timeout(world):
    messages = run_ranks(_attention_until_killed, world, (1, 3), timeout=40, lost=[1])
    for rank, message in enumerate(messages):
        if rank != 1:
            assert "from rank 1 within 3 s; rank 1 is dead or stalled" in message, message


def _unprepared(rank, world):
    transport = world_transport("copy_engine")
    shape = gather_shape("gather", [1] * world, (2,), torch.float32)
    with pytest.raises(RuntimeError, match="was not prepared"):
        transport.send_buffer(shape)
    transport.prepare([shape])
    transport.send_buffer(shape)
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_exchanges_must_be_prepared():
    run_ranks(_unprepared, 2)


def test_slot_layout_is_sized_for_the_largest_shape():
    small = ExchangeShape("qkv", ((2, 2), (1, 1)), (3, 4), torch.float32, head_groups=2)
    large = ExchangeShape("qkv", ((5, 5), (4, 4)), (3, 4), torch.float32, head_groups=1)
    layout = SlotLayout.for_shapes([small, large])
    assert layout.head_groups == (2,) and layout.recv_bytes == (512,)  # 9 rows of 48 bytes, aligned up
    assert layout.fits([small]) and not layout.fits([gather_shape("other", [1, 1], (2,), torch.float32)])
    # Rank 1's rows land after rank 0's in every receiver's slot.
    assert large.landing_row(1, 0) == 5 and large.landing_row(1, 1) == 5
    assert layout.credit_flag("qkv", 1, 0) == layout.n_flags // 2 + layout.data_flag("qkv", 1, 0)


def _hold_a_slot(rank, world):
    """Rank 1 keeps exchange 0's rows for a while; rank 0 runs ahead to exchange 2, which uses the same slot."""
    transport = world_transport("copy_engine", timeout_s=10.0)
    shape = gather_shape("gather", [1] * world, (4,), torch.float32)
    transport.prepare([shape])
    handles, seen = [], []
    for n in range(3):
        send = transport.send_buffer(shape)
        send.fill_(float(n))
        handles.append(transport.start(send, shape))
        if n == 0:
            rows = handles[0].wait()
            if rank == 1:
                time.sleep(0.5)  # without the credit, rank 0's exchange 2 would land here meanwhile
            seen.append(rows.clone())
            handles[0].release()
    for handle in handles[1:]:
        seen.append(handle.wait().clone())
        handle.release()
    return [t.unique().tolist() for t in seen]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_slot_is_not_overwritten_before_its_release():
    assert run_ranks(_hold_a_slot, 2) == [[[0.0], [1.0], [2.0]]] * 2


def _release_out_of_order(rank, world):
    transport = world_transport("copy_engine")
    shape = gather_shape("gather", [1] * world, (2,), torch.float32)
    transport.prepare([shape])
    handles = [transport.start(transport.send_buffer(shape), shape) for _ in range(2)]
    for handle in handles:
        handle.wait()
    with pytest.raises(RuntimeError, match="released in order"):
        handles[1].release()
    handles[0].release(), handles[1].release()
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_received_slots_are_released_in_order():
    run_ranks(_release_out_of_order, 2)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ulysses", "cfg_batch", "cfg_split"])
def test_copy_engine_on_two_gpus_equals_collective(tmp_path, layout):
    """Symmetric memory, a stream per peer, stream write/wait-value flags: the same bits as NCCL."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    configs = [
        tiny_config(
            *FAST,
            "launcher.world=2",
            "device=cuda",
            "model.dtype=fp32",
            f"layout={layout}",
            "layout.head_groups=2",
            f"transport={name}",
        )
        for name in ("collective", "copy_engine")
    ]
    compare_transports(tmp_path, 2, configs, backend="nccl")


def test_transport_mistakes_are_one_sentence():
    from ditrun.config import TransportConfig
    from ditrun.errors import UserError
    from ditrun.transport.registry import check_transport

    with pytest.raises(
        UserError, match=r"^transport='nccl' is not a known transport; allowed: collective, copy_engine\.$"
    ):
        check_transport(TransportConfig(name="nccl"))
    from ditrun.config import TestingConfig
    from ditrun.launch.faults import check_testing_config

    with pytest.raises(UserError, match=r"^testing.chaos_s=-1"):
        check_testing_config(TestingConfig(chaos_s=-1), 1, 1)
