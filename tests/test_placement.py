"""Node-aware placement: which node each rank is on, the rule that an SP group stays on one node,
the placement rank 0 prints, and the ``copy_engine`` sending to off-node peers through the
collective library because the placement says they are off-node.

The rule itself is pure (a plan and a node per rank); the rendezvous path is tested with forked
ranks that sign in under different node names, as ranks on different hosts do. Whole runs across
emulated hosts (their own host names, torchrun and mpiexec) are in test_multinode_launchers.py.
"""

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launching import latents, records, tiny_config
from ranks import run_ranks

from ditrun.config import TransportConfig
from ditrun.errors import UserError
from ditrun.launch import env, run_as_rank
from ditrun.launch.work import Work
from ditrun.parallel.layout import LayoutPlan
from ditrun.parallel.placement import Placement, format_ranks, node_names
from ditrun.run import worker
from ditrun.run.checks import check_config
from ditrun.timers import ExposedTransfer
from ditrun.transport.registry import make_transport

TWO_BY_TWO = ("n1", "n1", "n2", "n2")
THREE_AND_ONE = ("n1", "n1", "n1", "n2")


def refusal(plan: LayoutPlan, nodes, heads: int = 8) -> str:
    with pytest.raises(UserError) as err:
        Placement(plan, nodes).check(False, heads)
    return str(err.value)


def test_an_sp_group_on_two_nodes_is_refused_naming_nodes_ranks_and_what_fits():
    message = refusal(LayoutPlan("ulysses", 1, 1, 4, 1), TWO_BY_TWO)
    assert message == (
        "layout=ulysses with SP degree 4 would put SP group 0 (ranks 0-3) on nodes n1 (ranks 0-1) and n2 "
        "(ranks 2-3); an SP group must stay on one node: use an SP degree of at most 2 (layout.replicas=2; "
        "the nodes hold 2 ranks each), or set layout.allow_cross_node_sp=true."
    )


def test_uneven_nodes_name_the_split_group_and_the_node_sizes():
    message = refusal(LayoutPlan("ulysses", 2, 1, 2, 1), THREE_AND_ONE)
    assert "SP group 1 (ranks 2-3) on nodes n1 (rank 2) and n2 (rank 3)" in message
    assert "at most 1 (layout.replicas=4; the nodes hold 3 and 1 ranks)" in message


def test_cfg_split_is_refused_when_one_of_its_sp_groups_spans_two_nodes():
    # 8 ranks on nodes of 3, 3 and 2: cfg_split with SP degree 4 puts SP group 0 on n1 and n2.
    nodes = ("n1",) * 3 + ("n2",) * 3 + ("n3",) * 2
    message = refusal(LayoutPlan("cfg_split", 1, 2, 4, 1), nodes)
    assert "SP group 0 (ranks 0-3) on nodes n1 (ranks 0-2) and n2 (rank 3)" in message
    assert "at most 1 (layout.replicas=4; the nodes hold 3, 3 and 2 ranks)" in message


def test_what_fits_respects_the_head_count():
    # 6 ranks per node, 8 heads: 6 and 3 do not divide the heads, so 2 is the largest SP degree that fits.
    message = refusal(LayoutPlan("ulysses", 1, 1, 12, 1), ("a",) * 6 + ("b",) * 6, heads=24)
    assert "at most 6 (layout.replicas=2;" in message
    message = refusal(LayoutPlan("ulysses", 1, 1, 12, 1), ("a",) * 6 + ("b",) * 6, heads=8)
    assert "at most 2 (layout.replicas=6;" in message


@pytest.mark.parametrize(
    "plan",
    [
        LayoutPlan("cfg_split", 1, 2, 2, 1),
        LayoutPlan("ulysses", 2, 1, 2, 1),
        LayoutPlan("single", 4, 1, 1, 1),
        LayoutPlan("cfg_batch", 2, 1, 2, 1),
    ],
)
def test_cfg_pairs_and_replicas_may_span_nodes(plan):
    Placement(plan, TWO_BY_TWO).check(False, 8)


def test_allowed_explicitly_an_sp_group_may_span_nodes():
    placement = Placement(LayoutPlan("ulysses", 1, 1, 4, 1), TWO_BY_TWO)
    placement.check(True, 8)
    assert placement.split_sp_groups() == [0]


def test_placement_text_lists_each_node_its_ranks_and_groups():
    text = Placement(LayoutPlan("cfg_split", 2, 2, 1, 1), TWO_BY_TWO).describe()
    assert text == (
        "placement: n1: ranks 0-1 (replica 0: sp group 0 [cfg cond], sp group 1 [cfg uncond])\n"
        "           n2: ranks 2-3 (replica 1: sp group 2 [cfg cond], sp group 3 [cfg uncond])"
    )
    text = Placement(LayoutPlan("ulysses", 1, 1, 4, 1), THREE_AND_ONE).describe()
    assert text == (
        "placement: n1: ranks 0-2 (replica 0: sp group 0 (ranks 0-2 of 0-3))\n"
        "           n2: rank 3 (replica 0: sp group 0 (rank 3 of 0-3)); SP group(s) 0 span nodes"
    )


def test_placement_text_of_a_node_shared_by_two_replicas_and_two_split_groups():
    text = Placement(LayoutPlan("ulysses", 2, 1, 2, 1), ("n1", "n2", "n2", "n3")).describe()
    assert text == (
        "placement: n1: rank 0 (replica 0: sp group 0 (rank 0 of 0-1))\n"
        "           n2: ranks 1-2 (replica 0: sp group 0 (rank 1 of 0-1); replica 1: sp group 1 (rank 2 of 2-3))\n"
        "           n3: rank 3 (replica 1: sp group 1 (rank 3 of 2-3)); SP group(s) 0, 1 span nodes"
    )
    assert format_ranks([7, 1, 3, 2]) == "ranks 1-3, 7" and format_ranks([4]) == "rank 4"


def test_a_host_name_the_launcher_numbers_twice_is_two_nodes():
    """Two torchrun agents (or two slurmd -N) on one machine: one host name, two launcher node numbers."""
    assert node_names([("vm", 0), ("vm", 0), ("vm", 1), ("vm", 1)]) == ("vm/0", "vm/0", "vm/1", "vm/1")
    assert node_names([("a", 0), ("a", 0), ("b", 1), ("b", None)]) == ("a", "a", "b/1", "b/None")
    assert node_names([("a", None), ("b", None)]) == ("a", "b")


def test_launchers_number_and_name_the_node():
    torchrun = env.discover(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29400",
        }
    )
    assert (torchrun.node_index, torchrun.node_name) == (1, None)
    slurm = env.discover(
        {
            "SLURM_JOB_ID": "7",
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_NODEID": "1",
            "SLURMD_NODENAME": "n2",
            "SLURM_STEP_NODELIST": "n[1-2]",
        }
    )
    assert (slurm.node_index, slurm.node_name, slurm.node) == (1, "n2", "n2")


# -- the rendezvous path: forked ranks that sign in as ranks on two hosts ------------------------

FORK = mp.get_context("fork")


def _never_called(cfg, out_dir, job, nodes, hydra_files=None):
    raise AssertionError("the placement check must stop the ranks before the worker starts")


def _rank_on(node: str, rank: int, world: int, port: int, cfg, results) -> None:
    info = env.RankInfo("test", rank, rank % 2, world, 2, 2, "127.0.0.1", port, node_name=node)
    try:
        run_as_rank(cfg, Path(f"/tmp/ditrun-placement-{rank}"), info, Work(check_config, _never_called))
        results.put((rank, "ran"))
    except UserError as err:
        results.put((rank, str(err)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "nodes, overrides, refused",
    [
        (TWO_BY_TWO, [], "SP group 0 (ranks 0-3) on nodes n1 (ranks 0-1) and n2 (ranks 2-3)"),
        (THREE_AND_ONE, ["layout.replicas=2"], "SP group 1 (ranks 2-3) on nodes n1 (rank 2) and n2 (rank 3)"),
    ],
)
def test_ranks_of_two_hosts_refuse_a_split_sp_group_before_the_worker_starts(capfd, nodes, overrides, refused):
    cfg = tiny_config("layout=ulysses", "launcher.world=4", *overrides)
    port, results = env.free_port(), FORK.Queue()
    procs = [FORK.Process(target=_rank_on, args=(node, r, 4, port, cfg, results)) for r, node in enumerate(nodes)]
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=45) for _ in procs)
    for proc in procs:
        proc.join(10)
    assert sorted(got) == [0, 1, 2, 3]
    assert all(refused in message for message in got.values()), got
    out = capfd.readouterr().out
    assert out.count("placement: n1: ") == 1 and "ditrun: 4 ranks on 2 node(s)" in out


# -- the copy engine's off-node peers come from the placement ------------------------------------


def _both_transports_on(rank, world, configs, out_dirs, nodes, device_type):
    for cfg, out in zip(configs, out_dirs):
        worker.run(cfg, out, nodes=nodes)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    transport = make_transport(
        TransportConfig(name="copy_engine"), dist.group.WORLD, ExposedTransfer(device), device, 20.0, nodes
    )
    return transport.local


def compare_on_claimed_nodes(tmp_path, nodes, *overrides: str, backend: str = "gloo") -> list:
    """One SP group over ranks that claim ``nodes`` (allowed): collective, then copy_engine, on the same
    ranks; the copy engine's latents are the collective's, bit for bit. Returns each rank's map of local peers."""
    fast = [
        "model.num_layers=1",
        "model.num_single_layers=1",
        "metrics.ssim=false",
        "metrics.report=false",
        f"launcher.world={len(nodes)}",
        "layout=ulysses",
        "layout.allow_cross_node_sp=true",
        *overrides,
    ]
    configs = [tiny_config(*fast, f"transport={name}") for name in ("collective", "copy_engine")]
    out_dirs = [tmp_path / "collective", tmp_path / "copy_engine"]
    device_type = "cuda" if backend == "nccl" else "cpu"
    local = run_ranks(
        _both_transports_on, len(nodes), (configs, out_dirs, nodes, device_type), timeout=240, backend=backend
    )
    [expected], [found] = records(out_dirs[0]), records(out_dirs[1])
    assert found["transport"] == "copy_engine"
    assert torch.equal(latents(out_dirs[1], found["edit"]), latents(out_dirs[0], expected["edit"]))
    return local


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_copy_engine_sends_to_off_node_peers_through_the_collective(tmp_path):
    """Ranks 0-1 on n1 and 2-3 on n2, one SP group over both: the copy engine maps only its node's peer."""
    local = compare_on_claimed_nodes(tmp_path, TWO_BY_TWO, "layout.head_groups=2")
    assert local == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_copy_engine_on_two_gpus_of_two_claimed_nodes_equals_collective(tmp_path):
    """GPU 0 on n1, GPU 1 on n2: nothing is mapped, every exchange goes through NCCL/RCCL."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    local = compare_on_claimed_nodes(tmp_path, ("n1", "n2"), "device=cuda", "model.dtype=fp32", backend="nccl")
    assert local == [[True, False], [False, True]]
