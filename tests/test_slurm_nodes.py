"""ditrun on a two-node Slurm cluster emulated on this machine by ``slurm/local-cluster.sh``.

Each node is a ``slurmd`` of its own (``n1``, ``n2``) in its own UTS namespace, so its tasks see
their node's host name as on a real cluster, and ditrun's rendezvous records two hosts. The
results directory is one directory of this machine: the shared file system every node writes to.
Jobs run 2 tasks per node (``srun`` steps 1 where the layout allows): Ulysses groups of 2 stay on
one node, CFG pairs and replicas span both. Then the faults of many nodes: a node lost mid-run,
and two jobs on two nodes writing one results directory.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from launching import SIX, TINY, assert_same_latents, quiet_env, records, single_reference, six_edits
from test_launchers import start_rank
from test_slurm import CLUSTER_SCRIPT, DAEMONS, job_state, render_script, slurm, submit, wait_for_jobs
from tiers import missing

from ditrun.launch.env import free_port

pytestmark = pytest.mark.slow

NODES = 2
CPUS_PER_NODE = 6
SBATCH_TASKS = 2  # per node
# name: (layout overrides, tasks per node of the srun step).
# Ulysses: an SP group of 2 inside each node, one replica per node. cfg_split: 2 per node gives
# SP groups of 2 per node and CFG pairs (0, 2), (1, 3) across the nodes; 1 per node a pair across
# them. Replicas: one single-rank replica per rank ({world}: the job's ranks), on both nodes.
RUNS = {
    "ulysses": (["layout=ulysses", "layout.replicas=2"], 2),
    "cfg_split": (["layout=cfg_split"], 1),
    "replicas": (["layout=single", "layout.replicas={world}"], 1),
}
SRUN_RUNS = ("cfg_split",)
"""The layouts also started with ``srun -N2`` from a login shell: the CFG pair across the nodes, one task per
node. The sbatch jobs run every layout on both nodes already; a step per layout more cost the suite 2 cores'
worth of rank start-ups for the same code path."""
# SSIM off: the latents are compared with ``single``'s, and the BF16 references would cost more
# than the runs.
EDITS = ["workload.limit=3", "metrics.ssim=false", "metrics.report=false"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two emulated nodes; their SLURM_CONF is what every Slurm command here is given."""
    absent = [name for name in (*DAEMONS, "srun", "unshare") if shutil.which(name) is None]
    if absent:
        missing(
            "emulated Slurm node",
            f"Slurm is not installed here (no {', '.join(absent)}); `make install` as root installs "
            "slurm-wlm munge libpmix2",
        )
    if os.geteuid() != 0:
        missing("emulated Slurm node", "emulated nodes need root: each slurmd runs in its own UTS and mount namespace")
    state = tmp_path_factory.mktemp("slurm-nodes")
    try:  # stopped even when it failed half-way through starting
        started = subprocess.run(
            [str(CLUSTER_SCRIPT), "start", str(state), str(CPUS_PER_NODE), str(NODES)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert started.returncode == 0, started.stderr
        yield state / "slurm.conf"
    finally:
        subprocess.run([str(CLUSTER_SCRIPT), "stop", str(state)], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_reference(tmp_path_factory.mktemp("single"), *EDITS)


def overrides_of(name: str, tasks_per_node: int) -> list[str]:
    return [override.format(world=NODES * tasks_per_node) for override in RUNS[name][0]]


def srun(conf: Path, out: Path, tasks: int, *overrides: str, log: Path) -> subprocess.Popen:
    """``srun -N2`` straight from a login shell, as a user would run it interactively."""
    command = [
        "srun",
        f"-N{NODES}",
        f"--ntasks-per-node={tasks}",
        "--kill-on-bad-exit=1",
        "--time=10",
        "python",
        "-m",
        "ditrun",
        f"hydra.run.dir={out}",
        *TINY,
        *EDITS,
        *overrides,
    ]
    with open(log, "w") as sink:
        return subprocess.Popen(
            command, cwd=out.parent, stdout=sink, stderr=subprocess.STDOUT, env=quiet_env(SLURM_CONF=str(conf))
        )


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """Every layout once through the rendered sbatch script, and ``SRUN_RUNS`` through ``srun -N2``, all at once."""
    folder = tmp_path_factory.mktemp("runs")
    script = render_script(folder / "ditrun.sbatch", tasks=SBATCH_TASKS, nodes=NODES)
    jobs = {
        name: submit(cluster, script, folder / f"sbatch-{name}", *TINY, *EDITS, *overrides_of(name, SBATCH_TASKS))
        for name in RUNS
    }
    steps = {
        name: srun(
            cluster,
            folder / f"srun-{name}",
            RUNS[name][1],
            *overrides_of(name, RUNS[name][1]),
            log=folder / f"srun-{name}.log",
        )
        for name in SRUN_RUNS
    }
    try:
        states = wait_for_jobs(cluster, list(jobs.values()), timeout=240)
        codes = {name: step.wait(timeout=240) for name, step in steps.items()}
    finally:
        for step in steps.values():
            if step.poll() is None:
                step.kill()
    return folder, {name: (jobs[name], states[jobs[name]]) for name in RUNS}, codes


def layout_of(name: str) -> str:
    return RUNS[name][0][0].removeprefix("layout=")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", RUNS)
def test_sbatch_on_two_nodes_equals_single(runs, reference, name):
    folder, jobs, _ = runs
    job, state = jobs[name]
    log = (folder / f"slurm-{job}.out").read_text()
    assert (state["JobState"], state["ExitCode"], state["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), log
    assert "4 ranks on 2 node(s) (Slurm (srun))" in log
    assert_same_latents(folder / f"sbatch-{name}", reference, layout_of(name), NODES * SBATCH_TASKS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SRUN_RUNS)
def test_srun_on_two_nodes_equals_single(runs, reference, name):
    folder, _, codes = runs
    assert codes[name] == 0, (folder / f"srun-{name}.log").read_text()
    assert_same_latents(folder / f"srun-{name}", reference, layout_of(name), NODES * RUNS[name][1])


@pytest.mark.timeout(300)
def test_every_rank_reports_its_node_and_start_up(runs):
    """The ranks ran where Slurm put them (two per node, as their host names say), and the summary
    holds every rank's start-up."""
    folder, _, _ = runs
    summary = json.loads((folder / "sbatch-ulysses" / "summary.json").read_text())
    by_rank = summary["startup_by_rank"]
    assert [(r["rank"], r["host"]) for r in by_rank] == [(0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")]
    assert all(r["startup_s"] >= r["rendezvous_s"] > 0 for r in by_rank)
    assert summary["startup_s_max"] == max(r["startup_s"] for r in by_rank)


def node_processes(state_dir: Path, node: str) -> list[int]:
    """Every process of an emulated node: those in its slurmd's UTS namespace."""
    slurmd = (state_dir / f"slurmd-{node}.pid").read_text().strip()
    namespace = os.readlink(f"/proc/{slurmd}/ns/uts")
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "ns" / "uts") == namespace:
                pids.append(int(entry.name))
        except OSError:
            continue  # ended meanwhile
    return pids


def restart_node(conf: Path, node: str) -> None:
    subprocess.run(
        [
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
            f"hostname {node} && mount --bind '{conf.parent / 'hosts'}' /etc/hosts && "
            f"exec slurmd -f '{conf}' -N {node}",
        ],
        check=True,
        timeout=30,
    )


def wait_for_log(log: Path, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while text not in (found := log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"no {text!r} after {timeout} s in {log}:\n{found}"
        time.sleep(0.2)
    return found


@pytest.mark.timeout(300)
def test_a_lost_node_ends_the_job_naming_it_and_a_requeue_resumes(cluster, tmp_path):
    """Every process of node n2 (its slurmd, step daemon and ranks) is killed mid-run, as when a
    node fails: the ranks left name n2 and its ranks and end, Slurm takes n2 down and requeues the
    job; once n2 is back the job reruns and finishes the edits left, each exactly once."""
    out, log = tmp_path / "run", tmp_path / "slurm-{}.out"
    # cfg_split: the CFG pairs (0, 2) and (1, 3) span the nodes, so the loss surfaces in a collective.
    job = submit(
        cluster,
        render_script(tmp_path / "ditrun.sbatch", tasks=SBATCH_TASKS, nodes=NODES),
        out,
        *TINY,
        f"workload.manifest={six_edits(tmp_path)}",
        "workload.limit=null",
        "workload.width=64",
        "workload.height=64",
        "workload.steps=6",
        "layout=cfg_split",
        "metrics.ssim=false",
        "launcher.collective_timeout_s=20",
    )
    log = Path(str(log).format(job))
    deadline = time.monotonic() + 120
    while not any(path.stat().st_size for path in out.glob("edits*.jsonl")):
        assert time.monotonic() < deadline and job_state(cluster, job)["JobState"] in ("PENDING", "RUNNING")
        time.sleep(0.05)
    for pid in node_processes(cluster.parent, "n2"):
        os.kill(pid, signal.SIGKILL)
    wait_for_log(log, "NodeLost: lost node n2 (ranks 2-3, all of its ranks)", timeout=60)
    deadline = time.monotonic() + 60
    while job_state(cluster, job)["JobState"] in ("RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, f"job {job} still running 60 s after its node was lost"
        time.sleep(0.2)
    restart_node(cluster, "n2")
    # Slurm requeues a batch job whose node failed, at its own pace (REQUEUED, then PENDING); where the
    # job ended instead, requeue it here. "pending execution": Slurm requeued it in the meantime.
    if job_state(cluster, job)["JobState"] not in ("PENDING", "REQUEUED", "CONFIGURING", "RUNNING"):
        requeue = subprocess.run(
            ["scontrol", "requeue", job],
            capture_output=True,
            text=True,
            timeout=60,
            env=quiet_env(SLURM_CONF=str(cluster)),
        )
        assert requeue.returncode == 0 or "pending execution" in requeue.stderr, requeue.stderr
    state = wait_for_jobs(cluster, [job], timeout=180)[job]
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log.read_text()
    assert "ditrun: resuming, " in log.read_text()
    assert sorted(r["edit"] for r in records(out)) == sorted(SIX)  # each edit exactly once


@pytest.mark.timeout(300)
def test_runs_on_two_nodes_in_one_directory_never_record_an_edit_twice(cluster, tmp_path):
    """Two jobs, one on each node, started at once in one results directory: the lock holds across
    the nodes (one runs, the other finds every edit done or is refused naming the holder's host),
    and the directory ends with every edit once and nothing set aside."""
    out = tmp_path / "run"
    script = render_script(tmp_path / "ditrun.sbatch", tasks=1)
    jobs = [
        slurm(
            cluster,
            "sbatch",
            "--parsable",
            f"--nodelist={node}",
            f"--chdir={tmp_path}",
            str(script),
            *TINY,
            f"workload.manifest={six_edits(tmp_path)}",
            "workload.limit=null",
            "metrics.ssim=false",
            DITRUN_OUTPUT_DIR=str(out),
        ).strip()
        for node in ("n1", "n2")
    ]
    states = wait_for_jobs(cluster, jobs, timeout=240)
    logs = [(tmp_path / f"slurm-{job}.out").read_text() for job in jobs]
    codes = sorted(states[job]["ExitCode"] for job in jobs)
    assert codes in (["0:0", "0:0"], ["0:0", "2:0"]), logs
    if codes[1] == "2:0":
        assert any("is in use by another ditrun run (host n" in log for log in logs), logs
    assert sorted(r["edit"] for r in records(out)) == sorted(SIX)
    assert not (out / "edits.rejected.jsonl").exists()


@pytest.mark.timeout(180)
def test_ranks_killed_on_one_host_are_named_with_it_without_a_cluster(tmp_path):
    """The naming needs no Slurm (this runs where the cluster cannot): four ranks started by hand
    with torchrun's variables, ranks 2 and 3 killed mid-edit; ranks 0 and 1, whose CFG partners
    they were, fail naming them and this host instead of the connection error."""
    port, out = free_port(), tmp_path / "run"
    ranks = [
        start_rank(
            r, 4, port, out, tmp_path, "layout=cfg_split", "workload.limit=2", "workload.steps=24", "metrics.ssim=false"
        )
        for r in range(4)
    ]
    try:
        deadline = time.monotonic() + 120
        while not (out / "edits.jsonl").exists() or not (out / "edits.jsonl").read_text():
            assert time.monotonic() < deadline and all(rank.poll() is None for rank in ranks)
            time.sleep(0.02)
        for rank in ranks[2:]:
            rank.kill()
        codes = [rank.wait(timeout=60) for rank in ranks[:2]]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait(timeout=30)
    assert all(code != 0 for code in codes), codes
    logs = "".join((tmp_path / f"rank{r}.err").read_text() for r in (0, 1))
    assert f"NodeLost: lost ranks 2-3 on {socket.gethostname()}: no heartbeat for 2 s" in logs, logs
