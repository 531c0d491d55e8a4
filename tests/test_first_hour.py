"""A newcomer's first hour: the README's commands in a clean shell (``make run``, then ``ditrun``) and the Slurm
recipe from one, the help, progress in a log, and labels that say what ran."""

import io
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from ditrun_cli import TINY, ditrun
from skimage import io as io_image

from ditrun import timers
from ditrun.metrics import strip
from ditrun.metrics import wandb as wandb_log
from ditrun.metrics.progress import Activity, Progress
from ditrun.metrics.report import HEADER, write_report

REPO = Path(__file__).resolve().parents[1]
QUICK = [*TINY, "workload.limit=1", "wandb.mode=disabled"]


@pytest.mark.slow
def test_readme_commands_run_after_make_run_in_a_clean_environment(tmp_path):
    """Only what the README says: ``make run``, ``. .venv/bin/activate``, then bare ``ditrun`` commands, in a shell
    started by ``env -i`` (no PATH of ours, no venv). The venv is the one installed already: ``-o`` keeps make from
    installing it again when the Makefile is newer than its stamp."""
    args = " ".join(QUICK)
    script = f"""set -e
cd {REPO}
make -o .venv/.installed run ARGS='{args} hydra.run.dir={tmp_path}/run'
. .venv/bin/activate
ditrun --help > {tmp_path}/help.txt
ditrun report --help > {tmp_path}/report-help.txt
ditrun report {tmp_path}/run
"""
    proc = subprocess.run(
        ["env", "-i", f"HOME={tmp_path}", "bash", "--noprofile", "--norc", "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    made = proc.stdout.split(f"results: {tmp_path}/run\n", 1)[1]
    assert made.startswith("make: ditrun is .venv/bin/ditrun; to type plain ditrun, run '. .venv/bin/activate'")
    assert (tmp_path / "run" / "report.md").exists() and not (tmp_path / "outputs").exists()
    check_help((tmp_path / "help.txt").read_text())
    check_report_help((tmp_path / "report-help.txt").read_text())


def _conf_groups() -> dict[str, list[str]]:
    """The groups a user chooses from, read from the package's conf/ folder: each folder but hydra/, its files."""
    conf = REPO / "ditrun" / "conf"
    return {
        folder.name: sorted(p.stem for p in folder.glob("*.yaml"))
        for folder in conf.iterdir()
        if folder.is_dir() and folder.name not in ("hydra", "__pycache__")
    }


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    """A one-node Slurm cluster (slurm/local-cluster.sh) and the environment of a shell that has only the system's
    PATH and the cluster's config: no venv."""
    missing = [name for name in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}); `make install` as root installs it")
    state = tmp_path_factory.mktemp("slurm")
    try:
        started = subprocess.run([str(REPO / "slurm" / "local-cluster.sh"), "start", str(state)], capture_output=True)
        assert started.returncode == 0, started.stderr
        yield {"HOME": str(state), "PATH": "/usr/bin:/bin", "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run([str(REPO / "slurm" / "local-cluster.sh"), "stop", str(state)], capture_output=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_slurm_recipe_runs_from_a_shell_without_the_venv(tmp_path, slurm_env):
    """slurm/README.md's ``sbatch slurm/ditrun.sbatch ...`` from the repository's root, from a shell without the
    venv: the job runs the venv's ditrun by path, and its log lands in ``results/``, which git ignores. On CPUs: one
    task, no GPU (sbatch's options override the script's)."""
    job_log = None
    try:
        submit = ["sbatch", "--parsable", "--ntasks-per-node=1", "--gpus-per-node=0", "slurm/ditrun.sbatch"]
        env = {**slurm_env, "DITRUN_OUTPUT_DIR": str(tmp_path / "run")}
        job = subprocess.run([*submit, *QUICK], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert job.returncode == 0, job.stderr
        job_log = REPO / "results" / f"slurm-{job.stdout.strip()}.out"
        state = _job_end(job.stdout.strip(), slurm_env, timeout=150)
        assert state == "COMPLETED", state + (job_log.read_text() if job_log.exists() else "")
        assert f"results: {tmp_path / 'run'}" in job_log.read_text()
        ignored = subprocess.run(["git", "check-ignore", "-q", str(job_log)], cwd=REPO)
        assert ignored.returncode == 0, f"{job_log} is not ignored by git"
    finally:
        if job_log is not None:
            job_log.unlink(missing_ok=True)


def _job_end(job: str, env: dict, timeout: float) -> str:
    """The job's final state (scontrol: the local cluster keeps no accounting), polled more often than
    ``sbatch --wait`` does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", "--oneliner", job], env=env, capture_output=True, text=True)
        state = dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field).get("JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        time.sleep(0.3)
    raise AssertionError(f"job {job} still running after {timeout} s")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_slurm_sweep_refused_by_sbatch_is_one_sentence_and_one_that_runs_warns_of_sacct_once(tmp_path, slurm_env):
    """The launcher's default asks for 8 GPUs, which the local node lacks: sbatch refuses (an unknown gres), and
    ditrun says so in one sentence, exits 2 and leaves no sweep folder. A sweep that fits runs, and sacct (no
    accounting on the local cluster) is warned of once, however often submitit polls it."""
    env = {**slurm_env, "PYTHONUNBUFFERED": "1"}
    sweep = tmp_path / "refused"
    refused = ditrun("-m", "hydra/launcher=slurm", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=env)
    assert refused.returncode == 2, refused.stderr
    (sentence,) = [line for line in refused.stderr.splitlines() if line.startswith("ditrun: error:")]
    assert sentence.startswith("ditrun: error: sbatch refused the sweep's jobs (Invalid generic resource (gres)")
    assert "Traceback" not in refused.stderr and not sweep.exists()

    sweep = tmp_path / "runs"
    launcher = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.tasks_per_node=1"]
    ran = ditrun("-m", *launcher, *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr
    assert (sweep / "0" / "edits.jsonl").exists()
    assert (ran.stdout + ran.stderr).count("ditrun: warning: sacct") <= 1 and "Bypassing" not in ran.stdout + ran.stderr


def check_help(text: str) -> None:
    """``ditrun --help``: what ditrun does, how to call it, each group on one line (every option of ``conf/``'s
    folders), where results land."""
    assert "powered by Hydra" not in text and "__main__" not in text
    assert text.startswith("ditrun runs diffusion-transformer (DiT) image-editing inference")
    for form in ("ditrun [key=value ...]", "ditrun -m key=a,b", "ditrun report DIR", "ditrun warm [key=value ...]"):
        assert f"\n  {form}" in text
    lines = text.splitlines()
    for group, options in _conf_groups().items():
        (line,) = [line for line in lines if line.startswith(f"  {group}=")]  # one line each
        usage, phrase = line.split(maxsplit=1)
        assert sorted(usage.split("=", 1)[1].split("|")) == options and phrase
    assert any(line.startswith("  metrics.<key>=") for line in lines)
    assert "Results land in outputs/<date>/<time>/" in text


def check_report_help(text: str) -> None:
    assert text.startswith("usage: ditrun report DIR")
    assert "Compare the runs of a ditrun run or sweep directory" in text and "Writes report.md" in text


def test_progress_in_a_log_is_a_plain_line_while_a_phase_lasts_longer_than_the_interval():
    """Off a terminal, a slow phase (longer than the interval) gets lines naming it, its edit and step and its
    seconds so far; a quick one gets none; nothing has a carriage return. The clock is the test's."""
    now = [0.0]
    log = io.StringIO()  # not a terminal
    activity = Activity(every_s=3600, stream=log, clock=lambda: now[0])  # the test prints the lines itself
    with activity.phase("loading the model"):
        now[0] += 41
        assert activity.line() == "ditrun: loading the model, 41 s"
    assert activity.line() is None
    with Progress(True, 20, stream=io.StringIO(), activity=activity) as progress:
        for _ in range(2):
            progress.edit("skipped", 28).close()
            progress.advance()
        bar = progress.edit("astronaut", 28)
        for _ in range(12):
            bar.update(1)
        now[0] += 34
        with activity.phase("compiling"):
            now[0] += 7
            assert activity.line() == "ditrun: edit 3/20, astronaut step 12/28, compiling, 7 s"
        assert activity.line() == "ditrun: edit 3/20, astronaut step 12/28, 41 s"
        bar.close()
    assert activity.line() is None


def test_progress_lines_are_printed_by_the_interval_and_never_on_a_terminal():
    log = io.StringIO()
    activity = Activity(every_s=0.02, stream=log)
    with activity.phase("making the references"):
        time.sleep(0.3)  # a slow phase: several intervals
    lines = log.getvalue().splitlines()
    assert lines and all(re.fullmatch(r"ditrun: making the references, \d+ s", line) for line in lines)
    assert "\r" not in log.getvalue()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    activity = Activity(every_s=0.02, stream=terminal)
    with activity.phase("making the references"):
        time.sleep(0.1)
    assert terminal.getvalue() == ""  # the bars draw there instead


def _fake_run(path: Path, precision: str, dit_s: float, ssim: float, backends: list[str]) -> None:
    """A run's directory as the report reads it: summary.json (with the backends each component ran on)."""
    path.mkdir(parents=True)
    summary = {
        "config": {"model": {"preset": "tiny"}, "layout": {"name": "single"}, "precision": {"name": precision}},
        "precision": precision,
        "precision_detail": {"mlp": {"format": precision, "backends": backends}},
        "dit_s_median": dit_s,
        "ssim_median": ssim,
        "ssim_rerun_median": 1.0,
        "ssim_pct_of_rerun_median": 100 * ssim,
        "complete": True,
        "reference": {"steps": 2, "true_cfg_scale": "off"},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "edits.jsonl").write_text(json.dumps({"edit": "a", "dit_s": dit_s, "ssim": ssim}) + "\n")


def test_report_says_emulated_beside_the_verdict_and_explains_every_column_once(tmp_path):
    _fake_run(tmp_path / "bf16", "bf16", 2.0, 1.0, ["bf16"])
    _fake_run(tmp_path / "mxfp6", "mxfp6", 3.0, 0.985, ["emulation"])
    _fake_run(tmp_path / "fp8", "fp8", 1.0, 0.9, ["fp8_rowwise"])
    text, report = write_report(tmp_path)
    verdicts = {line.split()[0]: line.split()[-2:] for line in text.splitlines()[1:4]}
    assert verdicts["mxfp6"] == ["yes", "(emulated)"] and verdicts["fp8"][-1] == "no"
    for document in (text, report.read_text()):
        assert _legend_names(document, "run") == list(HEADER)  # each column once, in the table's order


def _legend_names(document: str, first: str) -> list[str]:
    """The names a legend explains (``name: meaning; name: ...``), with the parentheses' own names left out."""
    paragraph = document[document.index(f"\n{first}: ") :].strip().split("\n\n")[0]
    text = " ".join(paragraph.split())
    names, depth = [], 0
    for item in text.split("; "):
        if depth == 0:
            names.append(item.split(": ", 1)[0])
        depth += item.count("(") - item.count(")")
    return names


@pytest.mark.slow
def test_a_cpu_run_says_what_ran_and_leaves_no_empty_log(tmp_path):
    """Two spawned ranks on the CPU: the reference is named fp32, the device line has no nested parentheses, the
    launcher is ditrun's spawner, the table's columns are explained once under it; no carriage return in a log, no
    empty file in the run directory."""
    out = tmp_path / "run"
    proc = ditrun(
        *QUICK,
        "launcher.world=2",
        "layout=ulysses",
        f"metrics.full_quality_dir={tmp_path / 'references'}",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "ditrun: 2 ranks on 1 node(s) (ditrun's spawner) met at 127.0.0.1:" in proc.stdout
    assert any(line.startswith("ditrun: making the references of 1 edits (full quality: fp32,") for line in lines)
    header = next(line for line in lines if line.startswith("edit "))
    assert "(FP32)" in header.split() and "(BF16)" not in proc.stdout
    (device,) = [line.split("device: ", 1)[1] for line in lines if "device: " in line]
    assert device.endswith(", fp32") and "(" not in device
    assert (
        _legend_names(proc.stdout, "edit") == re.split(r"\s{2,}", header.strip()) and "(it ran in fp32)" in proc.stdout
    )
    assert "\r" not in proc.stdout + proc.stderr
    assert not [p.name for p in out.rglob("*") if p.is_file() and p.stat().st_size == 0]


def test_a_later_job_of_the_process_counts_its_start_up_from_its_own_start(monkeypatch):
    ages = iter([10.0, 20.0, 50.0, 53.0])  # the process's age at each reading
    monkeypatch.setattr(timers, "process_age_s", lambda: next(ages))
    startup = timers.Startup()
    startup.start_job()
    startup.at_age("startup_s")
    assert (startup.fields["imports_s"], startup.fields["startup_s"]) == (10.0, 20.0) and not startup.notes
    startup.start_job()  # the sweep's next job, in the same process
    startup.at_age("startup_s")
    assert (startup.fields["imports_s"], startup.fields["startup_s"]) == (None, 3.0)
    assert startup.notes == {"process": "reused"}


@pytest.mark.slow
def test_each_job_of_a_local_sweep_reports_its_own_start_up(tmp_path):
    sweep = tmp_path / "sweep"
    proc = ditrun("-m", *QUICK, "workload.steps=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, second = (json.loads((sweep / job / "summary.json").read_text())["startup_by_rank"] for job in "01")
    assert first[0]["imports_s"] > 0 and "process" not in first[0]
    assert second[0]["imports_s"] is None and second[0]["process"] == "reused"
    assert second[0]["startup_s"] != first[0]["startup_s"]  # its own, not the first job's
    assert not [p for p in sweep.rglob("*") if p.is_file() and p.stat().st_size == 0]  # no empty log either


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_rerun_line_after_a_submitit_sweep_keeps_the_launcher(tmp_path):
    """Through submitit's launcher on this machine (hydra/launcher=local): the report's command runs the chosen
    job again through the same launcher, with every override given."""
    sweep = tmp_path / "sweep"
    launcher = ["hydra/launcher=local", "hydra.launcher.timeout_min=5"]
    proc = ditrun("-m", *launcher, *QUICK, "workload.steps=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    command = lines[lines.index(next(line for line in lines if line.endswith("Run it again with:"))) + 1].split()
    jobs = [yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text()) for job in "01"]
    assert command[:4] == ["ditrun", "-m", *launcher] and command[4:] in jobs


@pytest.mark.slow
def test_hydras_hints_are_kept_whole(tmp_path):
    proc = ditrun("layout=ulysses,single", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("ditrun: error: Ambiguous value for argument 'layout=ulysses,single': ")
    assert line.endswith("; to sweep over it, add --multirun to your command line.")


def test_the_edits_picture_puts_the_outputs_scores_under_the_output(tmp_path):
    """edits.png's row: reference, output, correct edit; the output's PSNR against the correct edit and its margin
    are the output's, so they are written under the output, and the correct edit's cell is only titled."""
    (tmp_path / "images").mkdir()
    io_image.imsave(tmp_path / "images" / "astronaut.png", np.zeros((32, 32, 3), np.uint8), check_contrast=False)
    record = {
        "edit": "astronaut",
        "reference": "skimage:astronaut",
        "target": "grayscale",
        "width": 32,
        "height": 32,
        "image": "images/astronaut.png",
        "settings": {"edit": {"prompt": "make it black and white"}},
        "psnr_target": 27.48,
        "margin_db": 8.39,
    }
    pictures, titles, captions = strip._pictures(record, tmp_path, with_target=True)
    assert titles == ["astronaut", '"make it black and white"', "correct edit"]
    assert captions == ["", "27.5 dB to the correct edit, margin +8.4 dB", ""]
    assert [p.shape for p in pictures] == [(32, 32, 3)] * 3


def test_the_ssim_map_shows_where_the_output_differs_and_says_so_when_nowhere():
    local = np.ones((8, 8))
    local[2:4, 2:4] = 0.96  # a patch that differs; the rest identical
    picture, caption = wandb_log.ssim_map_picture(local, 0.999)
    assert picture.dtype == np.uint8 and picture[2:4, 2:4].min() == 255 and picture.sum() == 255 * 4
    assert caption == "SSIM map (0.9990): black = identical, white = local SSIM 0.9600"
    picture, caption = wandb_log.ssim_map_picture(np.ones((8, 8)), 1.0)
    assert not picture.any() and caption == "SSIM map (1.0000): identical everywhere"
