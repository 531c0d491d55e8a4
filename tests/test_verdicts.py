"""Quality verdicts through the real command, on the trained editor (docs/METRICS.md): every run of a sweep is
judged against one full-quality reference, a run known to be worse is never chosen, runs of another model are
listed apart, a crashed directory is incomplete, and a wrong edit fails the gate where a correct one passes."""

import json

import pytest
from ditrun_cli import ditrun, full_quality_dir

from ditrun.metrics.report import write_report

pytestmark = pytest.mark.slow

# One held-out picture at the size the editor was trained at, quietly.
ONE_EDIT = ["workload.limit=1", "wandb.mode=disabled", "progress=false"]


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _sweep(tmp_path, tmp_path_factory, *overrides, name="sweep"):
    sweep = tmp_path / name
    proc = ditrun(
        "-m",
        *ONE_EDIT,
        *overrides,
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        timeout=400,
    )
    return sweep, proc


@pytest.mark.timeout(450)
def test_fewer_steps_are_judged_against_the_sweeps_full_quality_reference(tmp_path, tmp_path_factory):
    """``-m workload.steps=1,8``: both runs are graded against the 8-step BF16 reference, so the 1-step run, 8x
    faster, is not "100%" of itself: it misses the target and the 8-step run is chosen."""
    sweep, proc = _sweep(tmp_path, tmp_path_factory, "workload.steps=1,8")
    assert proc.returncode == 0, proc.stderr
    one, eight = _summary(sweep / "0"), _summary(sweep / "1")
    assert one["reference"]["steps"] == eight["reference"]["steps"] == 8
    assert one["config"]["metrics"]["full_quality_steps"] == 8 and one["quality_measure"] == "target"
    assert one["ssim_pct_of_rerun_median"] < 90 and eight["ssim_pct_of_rerun_median"] == 100.0
    assert one["margin_db_median"] < eight["margin_db_median"] and one["edits_right_share"] == 0.0
    assert "Baseline (full quality: nothing quantized, no cache, 8 steps" in proc.stdout
    assert "Fastest run that meets it: `1: workload.steps=8`" in proc.stdout
    report = ditrun("report", str(sweep), "--quality", "rerun", cwd=tmp_path)
    assert report.returncode == 0 and "Fastest run that meets it: `1: workload.steps=8`" in report.stdout
    for measure in ("bf16", "target"):  # whichever measure judges (the command's report, in this process)
        text, _ = write_report(sweep, quality=measure)
        assert "Fastest run that meets it: `1: workload.steps=8`" in text, measure


@pytest.mark.timeout(450)
def test_a_cache_that_skips_most_steps_is_never_chosen(tmp_path, tmp_path_factory):
    """A static cache computing 2 of 8 steps is worse: the report never chooses it, whatever its speed."""
    sweep, proc = _sweep(tmp_path, tmp_path_factory, "cache=none,static", "cache.compute_steps=[0,1]")
    assert proc.returncode == 0, proc.stderr
    cached = _summary(sweep / "1")
    assert cached["steps_computed_median"] == 2
    assert "Fastest run that meets it: `0: cache=none`" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("1: cache=static"))
    assert row.split()[-1] == "no"


@pytest.mark.timeout(450)
def test_a_model_with_random_weights_is_listed_apart(tmp_path, tmp_path_factory):
    """``-m model=editor,tiny``: the random-weight run is 100% of its own BF16 reference, but it is another model:
    listed apart with that reason, never chosen, whatever its speed."""
    sweep, proc = _sweep(tmp_path, tmp_path_factory, "model=editor,tiny")
    assert proc.returncode == 0, proc.stderr
    assert "Not judged: `1: model=tiny`: not comparable: another model (model.path:" in proc.stdout
    assert "Fastest run that meets it: `0: model=editor`" in proc.stdout


@pytest.mark.timeout(450)
def test_a_directory_whose_last_run_crashed_is_incomplete(tmp_path, tmp_path_factory):
    """A finished run of one edit, then a run of two in the same directory that crashes in its new edit: the
    summary there is the first run's, which must not speak for the second; the report says incomplete."""
    out = tmp_path / "run"
    common = [
        "wandb.mode=disabled",
        "progress=false",
        "workload.steps=2",
        "workload.width=64",
        "workload.height=64",
        f"hydra.run.dir={out}",
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
    ]
    assert ditrun("workload.limit=1", *common, cwd=tmp_path, timeout=300).returncode == 0
    crashed = ditrun(
        "workload.limit=2",
        "testing.fault.crash_rank=0",
        "testing.fault.crash_at_step=1",
        *common,
        cwd=tmp_path,
        timeout=300,
    )
    assert crashed.returncode != 0
    assert _summary(out)["complete"] is True  # the first run's, left behind
    report = ditrun("report", str(out), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert "is incomplete: its last run wrote no summary (it is running, or crashed or was killed)" in report.stdout


@pytest.mark.timeout(450)
def test_a_wrong_edit_fails_the_gate_and_a_correct_one_passes(tmp_path, tmp_path_factory):
    """The editor asked to invert while the correct result is grayscale makes a wrong edit: its margin is at most 0
    dB (the inverted input is a candidate it does not beat), so the gate fails although the full-quality
    reference does the same; asked for grayscale, its margin is above 0 and the gate passes."""
    results = {}
    for name, prompt in (("wrong", "invert the colours"), ("right", "make it black and white")):
        manifest = tmp_path / f"{name}.jsonl"
        manifest.write_text(
            json.dumps({"id": "astronaut", "image": "skimage:astronaut", "prompt": prompt, "target": "grayscale"})
            + "\n"
        )
        out = tmp_path / name
        results[name] = (
            ditrun(
                f"workload.manifest={manifest}",
                "metrics.min_ssim_pct=98",
                "wandb.mode=disabled",
                "progress=false",
                f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
                f"hydra.run.dir={out}",
                cwd=tmp_path,
                timeout=300,
            ),
            out,
        )
    (wrong, wrong_dir), (right, right_dir) = results["wrong"], results["right"]
    record = json.loads((wrong_dir / "edits.jsonl").read_text())
    assert record["margin_db"] <= 0
    assert wrong.returncode == 1 and "quality gate failed: 0% of its edits beat doing nothing" in wrong.stderr
    assert right.returncode == 0, right.stderr
    assert json.loads((right_dir / "edits.jsonl").read_text())["margin_db"] > 0
    assert "edits right (beating the input and every other edit): 100%" in right.stdout
