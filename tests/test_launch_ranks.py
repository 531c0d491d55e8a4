"""Ranks meeting for real: forked processes, gloo, ditrun's rendezvous store and watchdog.

The work each rank runs here is a few real collectives (not the DiT), so that these tests
cover rendezvous, shared results directory, missing ranks and failure propagation in seconds.
"""

import multiprocessing
import queue
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ditrun.config import EditConfig, RunConfig
from ditrun.errors import UserError
from ditrun.launch import env, faults, run_as_rank, with_world
from ditrun.launch.rendezvous import format_ranks
from ditrun.launch.work import Work
from ditrun.run.checks import check_config

FORK = multiprocessing.get_context("fork")


def make_cfg(ranks=1, **launcher):
    """A valid config for ``ranks`` ranks (``single`` layout, one replica per rank), on the CPU
    even where a GPU is visible: these ranks are forked and exchange CPU tensors over gloo."""
    cfg = OmegaConf.structured(RunConfig)
    cfg.workload.edits = [EditConfig(id="astronaut", image="skimage:astronaut")]  # checked before any rank starts
    cfg.layout.replicas = ranks
    cfg.device = "cpu"
    for key, value in launcher.items():
        cfg.launcher[key] = value
    return cfg


def reduce_work(cfg, out_dir, job, nodes, hydra_files=None):
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {
        "sum": total.item(),
        "out_dir": str(out_dir),
        "world": cfg.launcher.world,
        "threads": torch.get_num_threads(),
    }


def failing_work(cfg, out_dir, job, nodes, hydra_files=None):
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 2:
        raise RuntimeError("the GPU caught fire")
    deadline = time.monotonic() + 50  # the others keep exchanging until the watchdog ends them
    while time.monotonic() < deadline:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.01)
    return {}


def rank_main(rank, world, port, cfg, work, results):
    info = env.RankInfo("test", rank, rank, world, world, 1, "127.0.0.1", port)
    try:
        results.put((rank, "ok", run_as_rank(cfg, Path(f"/tmp/ditrun-rank-{rank}"), info, Work(check_config, work))))
    except Exception as err:
        results.put((rank, "error", str(err)))
        raise


def start_ranks(ranks, world, cfg, work, port=None):
    port = port or env.free_port()
    results = FORK.Queue()
    procs = {r: FORK.Process(target=rank_main, args=(r, world, port, cfg, work, results)) for r in ranks}
    for proc in procs.values():
        proc.start()
    return procs, results, port


def join_all(procs, results, timeout=60):
    deadline = time.monotonic() + timeout
    for proc in procs.values():
        proc.join(max(deadline - time.monotonic(), 0.1))
    alive = [r for r, p in procs.items() if p.is_alive()]
    for proc in procs.values():
        if proc.is_alive():
            proc.kill()
    assert not alive, f"ranks {alive} still running after {timeout} s"
    out = {}  # ranks that a watchdog ended report nothing
    while True:
        try:
            rank, status, value = results.get(timeout=1)
        except queue.Empty:
            break
        out[rank] = (status, value)
    return {r: p.exitcode for r, p in procs.items()}, out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ranks_meet_reduce_and_share_rank_0s_results_dir():
    procs, results, _ = start_ranks(range(3), 3, make_cfg(3), reduce_work)
    codes, out = join_all(procs, results)
    assert codes == {0: 0, 1: 0, 2: 0}
    for rank in range(3):
        status, summary = out[rank]
        assert status == "ok" and summary["sum"] == 6.0 and summary["world"] == 3
        # Each rank was handed its own directory; all of them write to rank 0's.
        assert summary["out_dir"] == "/tmp/ditrun-rank-0"
        assert summary["threads"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_rendezvous_timeout_names_the_address_and_the_missing_ranks():
    cfg = make_cfg(6, rendezvous_timeout_s=3.0)
    procs, results, port = start_ranks([0, 1, 3, 5], 6, cfg, reduce_work)
    codes, out = join_all(procs, results)
    assert all(code != 0 for code in codes.values())
    status, message = out[0]
    assert status == "error"
    assert f"rendezvous at 127.0.0.1:{port} timed out after 3 s" in message
    assert "2 of 6 ranks did not arrive: ranks 2, 4." in message
    assert "ranks 2, 4" in out[3][1]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_without_rank_0_names_rank_0():
    procs, results, port = start_ranks([1], 2, make_cfg(2, rendezvous_timeout_s=1.0), reduce_work)
    codes, out = join_all(procs, results)
    assert codes[1] != 0
    assert f"rendezvous at 127.0.0.1:{port} failed" in out[1][1]
    assert "rank 0, which hosts it, did not arrive" in out[1][1]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_taken_port_is_named_with_the_key_that_moves_it():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        procs, results, port = start_ranks(
            [0], 2, make_cfg(2, rendezvous_timeout_s=2.0), reduce_work, port=busy.getsockname()[1]
        )
        codes, out = join_all(procs, results)
    assert codes[0] != 0
    assert f"rank 0 cannot listen on 127.0.0.1:{port}" in out[0][1] and "launcher.master_port" in out[0][1]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_one_failing_rank_stops_every_rank_and_is_named(capfd):
    start = time.monotonic()
    procs, results, _ = start_ranks(range(4), 4, make_cfg(4), failing_work)
    codes, out = join_all(procs, results, timeout=60)
    assert codes[2] == 1 and out[2] == ("error", "the GPU caught fire")
    # The others were inside collectives; their watchdogs ended them, not the 60 s collective timeout.
    assert {codes[r] for r in (0, 1, 3)} == {faults.PEER_FAILED_EXIT}
    assert set(out) == {2}
    stderr = capfd.readouterr().err
    for rank in (0, 1, 3):
        assert f"ditrun: rank 2 failed (RuntimeError: the GPU caught fire); stopping rank {rank}" in stderr
    assert time.monotonic() - start < 60


def test_launcher_world_must_agree_with_the_launcher():
    info = env.RankInfo("Slurm (srun)", 0, 0, 4, 4, 1, "n1", 20000)
    assert with_world(make_cfg(), info).launcher.world == 4  # left at 1: the launcher knows
    with pytest.raises(ValueError, match=r"launcher.world=8 but Slurm \(srun\) started 4 ranks; set launcher.world=4"):
        with_world(make_cfg(world=8), info)


def test_format_ranks():
    assert format_ranks([3]) == "rank 3"
    assert format_ranks([7, 1, 2, 3, 9]) == "ranks 1-3, 7, 9"


@pytest.mark.slow
def test_the_spawner_names_the_rank_that_vanished_not_its_victims():
    """A rank killed outright reports nothing; the ranks whose connections it broke report errors
    of their own, and the ones a watchdog stopped exit 3: the vanished rank is the one named."""
    from ditrun.launch import WorkerFailed, spawn

    with pytest.raises(WorkerFailed, match="rank 3 was killed by SIGKILL without reporting an error"):
        spawn._raise_first_failure([(1, "RuntimeError: Connection closed by peer")], [(1, 1), (3, -9), (0, 3)])
    with pytest.raises(WorkerFailed, match="rank 1 failed: RuntimeError: the GPU caught fire"):
        spawn._raise_first_failure([(1, "RuntimeError: the GPU caught fire")], [(1, 1), (0, 3), (2, 3)])
    with pytest.raises(UserError, match="layout=ulysses needs"):  # a config error comes back as itself
        mistake = UserError("layout=ulysses needs ...")
        spawn._raise_first_failure([(0, mistake), (1, mistake)], [(0, 2), (1, 2)])
