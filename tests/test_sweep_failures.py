"""A sweep whose jobs crash or are killed: the others run, each failed job is named in one line (its overrides, why), and the
sweep's report and table are written over the jobs that finished, the failed ones listed as incomplete."""

import os
import re
import signal
import subprocess
import sys

import pytest
from ditrun_cli import TINY, ditrun, full_quality_dir
from launching import stopped_process

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_sweep_with_crashing_jobs_names_each_and_reports_the_rest(tmp_path, tmp_path_factory):
    sweep = tmp_path / "sweep"
    proc = ditrun(
        "-m",
        *TINY,
        "wandb.mode=disabled",
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
        "testing.fault.crash_rank=null,0",  # jobs 2 and 3 crash, at steps 0 and 1
        "testing.fault.crash_at_step=0,1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr
    for job, step in ((2, 0), (3, 1)):
        named = re.findall(rf"^ditrun: error: job {job} \((.*)\) failed: (.*)$", proc.stderr, re.MULTILINE)
        assert len(named) == 1, proc.stderr
        overrides, why = named[0]
        assert f"testing.fault.crash_rank=0 testing.fault.crash_at_step={step}" in overrides
        assert why.startswith(f"InjectedFault: rank 0 failed on purpose at denoising step {step}")
        assert f"  {sweep / str(job)} ({overrides}): {why}" in proc.stderr  # listed again at the end
    assert "ditrun: error: 2 job(s) of the sweep failed:" in proc.stderr
    assert f"sweep report: {sweep / 'report.md'}" in proc.stdout
    rows = {line.split(":")[0]: line for line in proc.stdout.splitlines() if re.match(r"^\d: testing", line)}
    assert set(rows) == {"0", "1", "2", "3"}
    assert all(re.search(r"\d\.\d{4}", rows[j]) for j in ("0", "1"))  # the finished jobs' times
    assert all(rows[j].rstrip().endswith("incomplete") for j in ("2", "3"))
    markdown = (sweep / "report.md").read_text()
    assert markdown.count("**incomplete** (its job failed: InjectedFault") == 2


@pytest.mark.timeout(200)
def test_a_submitit_sweep_names_its_crashed_job_and_reports_the_rest(tmp_path, tmp_path_factory):
    """Through submitit's local launcher (``hydra/launcher=local``: each job a process of its own, as on Slurm): the
    crashed job's traceback stays in its log, and the sweep's own process names it in one line, writes the report
    with it as incomplete, names it again at the end and exits 1."""
    sweep = tmp_path / "sweep"
    proc = ditrun(
        "-m",
        *TINY,
        "wandb.mode=disabled",
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
        "testing.fault.crash_rank=null,0",  # job 1 crashes at step 0
        "hydra/launcher=local",
        "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    named = re.findall(r"^ditrun: error: job 1 \((.*)\) failed: (.*)$", proc.stderr, re.MULTILINE)
    assert len(named) == 1, proc.stderr
    overrides, why = named[0]
    assert "testing.fault.crash_rank=0" in overrides and why.startswith("InjectedFault: rank 0 failed on purpose")
    assert f"ditrun: error: 1 job(s) of the sweep failed:\n  {sweep / '1'} ({overrides}): {why}" in proc.stderr
    assert f"sweep report: {sweep / 'report.md'}" in proc.stdout
    rows = {line.split(":")[0]: line for line in proc.stdout.splitlines() if re.match(r"^\d: testing", line)}
    assert re.search(r"\d\.\d{4}", rows["0"]) and rows["1"].rstrip().endswith("incomplete")
    assert (sweep / "report.md").read_text().count("**incomplete** (its job failed: InjectedFault") == 1


@pytest.mark.timeout(200)
def test_a_submitit_job_killed_outright_is_named_and_the_sweep_reports_the_rest(tmp_path, tmp_path_factory):
    """A job of a ``hydra/launcher=local`` sweep killed outright (SIGKILL: it writes no result, as under the OOM
    killer): the sweep goes on, names it in one line (its overrides, how it ended), writes the report with it as
    incomplete, names it again at the end and exits 1, with no traceback."""
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, "wandb.mode=disabled", f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}"]
    args += ["testing.fault.freeze_rank=null,0", "hydra/launcher=local", "hydra.launcher.timeout_min=5"]
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        command = subprocess.Popen(  # job 1 stops itself at its first step, then this test kills it
            [sys.executable, "-m", "ditrun", *args, f"hydra.sweep.dir={sweep}"],
            cwd=tmp_path,
            stdout=out,
            stderr=err,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        try:
            os.kill(stopped_process(lambda pid, stat: int(stat[3]) == command.pid, 150), signal.SIGKILL)
            assert command.wait(timeout=120) == 1, (tmp_path / "err.txt").read_text()
        finally:
            if command.poll() is None:
                os.killpg(command.pid, signal.SIGKILL)
    stdout, stderr = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert "Traceback" not in stderr
    named = re.findall(r"^ditrun: error: job 1 \((.*)\) failed: (.*)$", stderr, re.MULTILINE)
    assert len(named) == 1, stderr
    overrides, why = named[0]
    assert "testing.fault.freeze_rank=0" in overrides
    assert re.match(r"submitit job \d+ ended without a result \(state: \w+\): it exited early or was killed", why), why
    assert f"ditrun: error: 1 job(s) of the sweep failed:\n  {sweep / '1'} ({overrides}): {why}" in stderr
    assert f"sweep report: {sweep / 'report.md'}" in stdout
    rows = {line.split(":")[0]: line for line in stdout.splitlines() if re.match(r"^\d: testing", line)}
    assert re.search(r"\d\.\d{4}", rows["0"]) and rows["1"].rstrip().endswith("incomplete")
    assert (sweep / "report.md").read_text().count("**incomplete** (its job failed: submitit job") == 1


def test_a_sweep_run_again_in_its_directory_forgets_the_failures_of_the_last(tmp_path):
    """The failed jobs' notes of an earlier sweep in the same directory are removed when the next sweep there starts
    (before any job runs): a job that finishes this time is not named as failed."""
    from omegaconf import OmegaConf

    from ditrun.metrics.report import FAILED_DIR, FAILED_JOBS, SweepReport, collect_failed_jobs

    note = tmp_path / FAILED_DIR / "1.json"
    note.parent.mkdir()
    note.write_text('{"folder": "%s", "number": 1, "overrides": ["a=1"], "why": "Boom"}' % (tmp_path / "1"))
    collect_failed_jobs(tmp_path)
    assert FAILED_JOBS.pop(tmp_path / "1") == (["a=1"], "Boom")
    SweepReport().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    collect_failed_jobs(tmp_path)
    assert tmp_path / "1" not in FAILED_JOBS and not note.exists()
