"""ditrun on a real Slurm cluster: one node started for this module by ``slurm/local-cluster.sh``.

The node declares 8 CPUs on a 2-core machine, so jobs of 2 and 4 tasks run side by side. Every
job is the real thing: the rendered sbatch script, ``srun`` tasks as ditrun ranks, Hydra's
submitit launcher submitting a job array, Slurm requeueing a job that then resumes.
"""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from launching import (
    SIX,
    TINY,
    assert_same_latents,
    quiet_env,
    records,
    single_reference,
    six_edits,
    stopped_process,
)
from tiers import missing
from wandb_files import wandb_contents

from ditrun.launch.env import expand_hostlist

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "slurm" / "local-cluster.sh"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running one-node cluster; its SLURM_CONF is what every Slurm command here is given."""
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        missing(
            "Slurm",
            f"Slurm is not installed here (no {', '.join(absent)}); `make install` as root installs "
            "slurm-wlm munge libpmix2",
        )
    state = tmp_path_factory.mktemp("slurm")
    try:  # stopped even when it failed half-way through starting
        started = subprocess.run([str(CLUSTER_SCRIPT), "start", str(state)], capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
        yield state / "slurm.conf"
    finally:
        subprocess.run([str(CLUSTER_SCRIPT), "stop", str(state)], capture_output=True, timeout=60)


def slurm(conf: Path, *command: str, **extra_env: str) -> str:
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env=quiet_env(SLURM_CONF=str(conf), **extra_env)
    )
    assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr}"
    return proc.stdout


def job_state(conf: Path, job: str) -> dict:
    fields = slurm(conf, "scontrol", "show", "job", "--oneliner", job).split()
    return dict(field.split("=", 1) for field in fields if "=" in field)


def wait_for_jobs(conf: Path, jobs: list[str], timeout: float) -> dict:
    """Final states of ``jobs``; fails when one has not ended within ``timeout`` seconds."""
    deadline, ended = time.monotonic() + timeout, {}
    while len(ended) < len(jobs):
        for job in set(jobs) - set(ended):
            state = job_state(conf, job)
            if state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                ended[job] = state
        assert time.monotonic() < deadline, f"jobs {sorted(set(jobs) - set(ended))} still running after {timeout} s"
        time.sleep(0.2)
    return ended


def render_script(path: Path, tasks: int, nodes: int = 1) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ditrun.launch.slurm",
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            str(tasks),
            "--time",
            "00:10:00",
            "--log",
            str(path.parent / "slurm-%j.out"),
            "-o",
            str(path),
        ],
        check=True,
        timeout=60,
    )
    return path


def submit(conf: Path, script: Path, out: Path, *overrides: str) -> str:
    return slurm(
        conf, "sbatch", "--parsable", f"--chdir={script.parent}", str(script), *overrides, DITRUN_OUTPUT_DIR=str(out)
    ).strip()


def test_hostlists_expand_like_scontrol(cluster):
    for hostlist in ("n1", "login1,n[1-2]", "gpu[01-03,7]", "a[098-101]", "rack[1-2]-n[08-10]"):
        expected = slurm(cluster, "scontrol", "show", "hostnames", hostlist).split()
        assert expand_hostlist(hostlist) == expected


SBATCH_RUNS = [(4, "cfg_split")]
"""The rendered template's job here: two SP groups of two; two-task jobs of every layout run in the submitit sweep
below, with the same check against ``single``, and the same template runs ``ulysses`` on four ranks (two nodes) in
test_slurm_nodes.py."""


@pytest.fixture(scope="module")
def sbatch_runs(cluster, tmp_path_factory):
    """The jobs submitted at once (the node declares 8 CPUs)."""
    folder = tmp_path_factory.mktemp("sbatch")
    scripts = {tasks: render_script(folder / f"ditrun-{tasks}.sbatch", tasks) for tasks, _ in SBATCH_RUNS}
    jobs = {
        (tasks, layout): submit(cluster, scripts[tasks], folder / f"{layout}-{tasks}", *TINY, f"layout={layout}")
        for tasks, layout in SBATCH_RUNS
    }
    states = wait_for_jobs(cluster, list(jobs.values()), timeout=240)
    return folder, {key: (job, states[job]) for key, job in jobs.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_reference(tmp_path_factory.mktemp("single"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tasks, layout", SBATCH_RUNS)
def test_sbatch_template_runs_every_task_as_a_rank(sbatch_runs, reference, tasks, layout):
    folder, jobs = sbatch_runs
    job, state = jobs[(tasks, layout)]
    log = (folder / f"slurm-{job}.out").read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert f"layout {layout} (1 replica(s) x {tasks} worker(s))" in log
    out = folder / f"{layout}-{tasks}"
    assert_same_latents(out, reference, layout, tasks)
    # Hydra's files, written by global rank 0 once the directory is the run's.
    assert f"layout={layout}" in yaml.safe_load((out / ".hydra" / "overrides.yaml").read_text())


@pytest.mark.timeout(300)
def test_submitit_slurm_sweep_runs_one_multi_task_job_per_layout(cluster, reference, tmp_path):
    sweep = tmp_path / "sweep"
    layouts = ["ulysses", "cfg_batch", "cfg_split"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ditrun",
            "-m",
            "hydra/launcher=slurm",  # ditrun's preset; the local node has no GPUs to tie the tasks to
            "hydra.launcher.gpus_per_node=null",
            "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.timeout_min=10",
            f"hydra.sweep.dir={sweep}",
            *TINY,
            f"layout={','.join(layouts)}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env=quiet_env(SLURM_CONF=str(cluster)),
    )
    assert proc.returncode == 0, proc.stderr
    for number, layout in enumerate(layouts):
        job_dir = sweep / str(number)  # Hydra's sweep subdir: the job number
        assert (job_dir / "summary.json").exists(), proc.stderr
        assert [(r["layout"], r["world"]) for r in records(job_dir)] == [(layout, 2)]
        assert_same_latents(job_dir, reference, layout, 2)
        assert f"layout={layout}" in yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text())
    script = next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --signal=USR2@120" in script  # from the preset


@pytest.mark.timeout(300)
def test_a_job_signalled_before_its_time_limit_requeues_and_resumes(cluster, tmp_path):
    """The script's USR1 trap (what ``--signal`` sends before the time limit) requeues the job;
    the rerun, same job id and results directory, finishes the edits left."""
    manifest = six_edits(tmp_path)
    out = tmp_path / "run"
    job = submit(
        cluster,
        render_script(tmp_path / "ditrun.sbatch", 2),
        out,
        *TINY,
        f"workload.manifest={manifest}",
        "workload.limit=null",
        "workload.width=128",
        "workload.height=128",
        "workload.steps=8",
        "layout.replicas=2",
        "wandb.mode=offline",
    )
    deadline = time.monotonic() + 120
    while not (out / "edits.jsonl").exists() or len(records(out)) < 2:
        assert time.monotonic() < deadline and job_state(cluster, job)["JobState"] in ("PENDING", "RUNNING")
        time.sleep(0.05)
    slurm(cluster, "scancel", "--signal=USR1", "--batch", job)
    # The local cluster holds a requeued job cred_expire + 1 = 6 s (120 s by default).
    state = wait_for_jobs(cluster, [job], timeout=180)[job]
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    assert f"ditrun: time limit near, requeueing job {job}" in log
    assert "ditrun: resuming, " in log
    assert sorted(r["edit"] for r in records(out)) == sorted(SIX)  # each edit exactly once
    # One W&B run across the requeue: every attempt's offline file carries one run id; together their history
    # holds every edit once (both replicas' edits, each by its edit_index), at steps that only go up. (The first
    # attempt, killed by the requeue, may have written none of its rows: the second then logs them.)
    runs = [wandb_contents(path) for path in sorted(out.glob("wandb/offline-run-*/run-*.wandb"))]
    assert len(runs) == 2 and {run.run_id for run, _, _ in runs if run is not None} == {runs[-1][0].run_id}
    rows = [row for _, history, _ in runs for row in history if "dit_s" in row]
    by_edit = {r["edit"]: r for r in records(out)}
    assert sorted(row["edit_index"] for row in rows) == list(range(len(SIX)))
    edits = json.loads((out / "run.json").read_text())["edits"]
    assert all(row["dit_s"] == by_edit[edits[row["edit_index"]]]["dit_s"] for row in rows)
    assert [row["_step"] for row in rows] == sorted(row["_step"] for row in rows)
    assert runs[-1][2]["attempt"] == 2 and runs[-1][2]["restarts"] == {"SLURM_RESTART_COUNT": 1}
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["attempt"], summary["restarts"]) == (2, {"SLURM_RESTART_COUNT": 1})


@pytest.mark.timeout(300)
def test_a_preempted_submitit_job_requeues_itself_and_resumes(cluster, tmp_path):
    """USR2, what Slurm sends a submitit job on preemption: submitit checkpoints Hydra's launcher
    (which resubmits itself unchanged) and requeues; the rerun resumes in the same job directory."""
    manifest = six_edits(tmp_path)
    sweep = tmp_path / "sweep"
    # timeout_min is generous so that submitit reads the signal as a preemption, not a time-out.
    command = [
        sys.executable,
        "-m",
        "ditrun",
        "-m",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=60",
        f"hydra.sweep.dir={sweep}",
        *TINY,
        f"workload.manifest={manifest}",
        "workload.limit=null",
        "workload.width=128",
        "workload.height=128",
        "workload.steps=8",
        "layout=single",
        "layout.replicas=2",
    ]
    with open(tmp_path / "sweep.log", "w") as log:
        submitter = subprocess.Popen(
            command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=quiet_env(SLURM_CONF=str(cluster))
        )
    try:
        out = sweep / "0"
        deadline = time.monotonic() + 120
        while not (out / "edits.jsonl").exists() or len(records(out)) < 2:
            assert time.monotonic() < deadline and submitter.poll() is None, (tmp_path / "sweep.log").read_text()
            time.sleep(0.05)
        job = next(path.name for path in (sweep / ".submitit").iterdir() if path.name.isdigit())
        slurm(cluster, "scancel", "--signal=USR2", job)
        assert submitter.wait(timeout=200) == 0, (tmp_path / "sweep.log").read_text()
    finally:
        if submitter.poll() is None:
            submitter.kill()
    task_log = (sweep / ".submitit" / job / f"{job}_0_log.out").read_text()
    assert "this job is preempted" in (sweep / ".submitit" / job / f"{job}_0_log.err").read_text()
    assert "ditrun: resuming, " in task_log
    assert job_state(cluster, job)["Restarts"] == "1"
    assert sorted(r["edit"] for r in records(out)) == sorted(SIX)  # each edit exactly once


@pytest.mark.timeout(240)
def test_a_cancelled_job_of_a_submitit_sweep_is_named_and_the_sweep_reports_the_rest(cluster, tmp_path):
    """scancel of a sweep's job (stopped at its first step: ``testing.fault.freeze_rank``) on the local cluster, whose
    missing accounting leaves submitit unable to tell that the job ended: the sweep's launcher asks the controller,
    names the job in one line (Slurm's state, its log's last line), reports the other job and exits 1."""
    sweep = tmp_path / "sweep"
    launcher = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null", "hydra.launcher.tasks_per_node=1"]
    # Two edits: scancel resumes the stopped job (SIGCONT) before its SIGTERM, and a job in its last edit would
    # finish it within Slurm's KillWait and return a result; with a second edit it stops at that edit's start.
    edits = [arg for arg in TINY if not arg.startswith("workload.limit=")] + ["workload.limit=2"]
    command = [sys.executable, "-m", "ditrun", "-m", *launcher, f"hydra.sweep.dir={sweep}", *edits]
    with open(tmp_path / "sweep.log", "w") as log:
        submitter = subprocess.Popen(
            [*command, "testing.fault.freeze_rank=null,0"],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=quiet_env(SLURM_CONF=str(cluster)),
        )
    try:
        ours = f"SLURM_CONF={cluster}\0".encode()
        frozen = stopped_process(lambda pid, stat: ours in Path(f"/proc/{pid}/environ").read_bytes(), 150)
        env = dict(v.split("=", 1) for v in Path(f"/proc/{frozen}/environ").read_text().split("\0") if "=" in v)
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        slurm(cluster, "scancel", job)
        assert submitter.wait(timeout=120) == 1, (tmp_path / "sweep.log").read_text()
    finally:
        if submitter.poll() is None:
            submitter.kill()
    text = (tmp_path / "sweep.log").read_text()
    assert "Traceback" not in text and job.endswith("_1")
    named = re.findall(r"^ditrun: error: job 1 \((.*)\) failed: (.*)$", text, re.MULTILINE)
    assert len(named) == 1, text
    overrides, why = named[0]
    assert "testing.fault.freeze_rank=0" in overrides
    assert why.startswith(f"submitit job {job} ended without a result (state: CANCELLED): it exited early"), why
    assert f"ditrun: error: 1 job(s) of the sweep failed:\n  {sweep / '1'} ({overrides}): {why}" in text
    assert (sweep / "0" / "summary.json").exists() and f"sweep report: {sweep / 'report.md'}" in text
    assert (sweep / "report.md").read_text().count("**incomplete** (its job failed: submitit job") == 1


@pytest.mark.timeout(240)
def test_a_warm_job_through_the_slurm_launcher_fills_its_entry(cluster, tmp_path):
    """``ditrun warm`` as a Slurm job (``-m hydra/launcher=slurm``) on the local cluster: the job compiles the size it
    is given into the shared compile cache, says so in its log and warm.json, and a second warm finds it there."""
    sweep, cache = tmp_path / "sweep", tmp_path / "compile-cache"
    launcher = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null", "hydra.launcher.tasks_per_node=1"]
    compiled = ["model.compile=on", "model.num_layers=1", "model.num_single_layers=1", f"model.compile_cache={cache}"]
    command = [sys.executable, "-m", "ditrun", "warm", "-m", *launcher, *TINY, *compiled, "warm.sizes=[[32,48]]"]
    env = quiet_env(SLURM_CONF=str(cluster), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for attempt, done in ((0, "filled"), (1, "already there")):
        out = sweep / str(attempt)
        proc = subprocess.run(
            [*command, f"hydra.sweep.dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=200, env=env
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        (size,) = json.loads((out / "0" / "warm.json").read_text())["sizes"]
        assert (size["size"], size["done"]) == ("32x48 output, 32x48 reference", done)
        assert Path(size["entry"]).parent == cache and Path(size["entry"]).is_file()
        log = "".join(p.read_text() for p in (out / ".submitit").rglob("*_log.out"))
        assert f"ditrun: warm: 32x48 output, 32x48 reference (7 text + 12 image tokens): {done}" in log
