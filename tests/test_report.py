"""``ditrun report``: the comparison table, report.md and its charts, from ditrun's own files."""

import json

import pytest
from ditrun_cli import PLAIN, TINY, ditrun, full_quality_dir
from skimage import io
from test_wandb import run_contents

from ditrun.metrics.report import main as report_main
from ditrun.metrics.report import write_report

pytestmark = pytest.mark.slow


def _chart_ok(path):
    image = io.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0


@pytest.mark.timeout(400)
def test_report_compares_the_three_runs_of_a_sweep(tmp_path, tmp_path_factory):
    sweep = tmp_path / "sweep"
    proc = ditrun(
        "-m",
        *TINY,
        "workload.steps=1,2,3",
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"sweep report: {sweep / 'report.md'}" in proc.stdout  # written when the multirun ended

    # One W&B run per job, grouped by the sweep, named apart.
    runs = [run_contents(sweep / str(job))[0] for job in range(3)]
    assert {r.run_group for r in runs} == {f"{tmp_path.name}/sweep"}
    assert [r.display_name for r in runs] == [f"single-{PLAIN}-collective-w1-job{j}" for j in range(3)]

    (sweep / "report.md").unlink()
    report = ditrun("report", str(sweep), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0].split()[:3] == ["run", "layout", "precision"]
    medians = [json.loads((sweep / str(j) / "summary.json").read_text())["dit_s_median"] for j in range(3)]
    # Every run is judged against the sweep's full-quality reference, of 3 steps: that run is the baseline.
    for job in range(3):
        row = next(line for line in lines if line.startswith(f"{job}: workload.steps={job + 1}"))
        assert "single" in row and PLAIN in row and ("1.0000" in row and "100.00" in row) == (job == 2)
        assert f"{medians[job]:.4f}" in row and f"{medians[2] / medians[job]:.2f}x" in row
        assert ("(baseline)" in row) == (job == 2)
    assert lines[-1] == f"report: {sweep / 'report.md'}"

    markdown = (sweep / "report.md").read_text()
    assert markdown.count(f"| single | {PLAIN} | collective | 1 |") == 3
    assert "![DiT time per edit](dit_time.png)" in markdown and "![SSIM per precision](ssim.png)" in markdown
    _chart_ok(sweep / "dit_time.png")
    _chart_ok(sweep / "ssim.png")


def _fake_run(path, layout, precision, world, dit_s, exposed_s, ssim):
    """A run directory as ditrun writes it (summary.json and edits.jsonl), with chosen numbers."""
    path.mkdir(parents=True)
    config = {
        "layout": {"name": layout},
        "precision": {"name": precision},
        "transport": {"name": "collective"},
        "launcher": {"world": world},
    }
    summary = {
        "config": config,
        "dit_s_median": dit_s,
        "exposed_transfer_s_median": exposed_s,
        "exposed_transfer_pct_median": 100 * exposed_s / dit_s,
        "ssim_median": ssim,
        "ssim_rerun_median": 0.99 if ssim else None,
        "ssim_pct_of_rerun_median": ssim and 100 * ssim / 0.99,
    }
    (path / "summary.json").write_text(json.dumps(summary))
    record = {"edit": "a", "dit_s": dit_s, "exposed_transfer_s": exposed_s, "ssim": ssim}
    (path / "edits.jsonl").write_text(json.dumps(record) + "\n")


def test_speedup_is_against_the_single_process_bf16_run_and_needs_no_wandb(tmp_path):
    _fake_run(tmp_path / "a", "ulysses", "mxfp8", 4, dit_s=2.0, exposed_s=0.5, ssim=0.97)
    _fake_run(tmp_path / "b", "single", "bf16", 1, dit_s=6.0, exposed_s=0.0, ssim=0.99)
    _fake_run(tmp_path / "c", "cfg_split", "bf16", 8, dit_s=9.0, exposed_s=1.0, ssim=None)
    text, report = write_report(tmp_path, baseline=None)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert rows["a"][5:11] == ["2.0000", "3.00x", "25.0", "0.9700", "0.9900", "97.98"]
    assert rows["b"][1] == "(baseline)" and rows["b"][6:8] == ["6.0000", "1.00x"]
    assert rows["c"][5:11] == ["9.0000", "0.67x", "11.1", "-", "-", "-"]
    text, _ = write_report(tmp_path, baseline="c")
    assert "c (baseline)" in text
    assert (tmp_path / "dit_time.png").is_file() and (tmp_path / "ssim.png").is_file()
    assert report == tmp_path / "report.md" and "Speedup is relative to `c`" in report.read_text()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing", "is not a directory; give a ditrun run or multirun directory."),
        (lambda p: p, "holds no ditrun run (no summary.json or run.json in it or below it)."),
    ],
)
def test_report_of_a_directory_without_runs_is_one_sentence(tmp_path, capsys, make, message):
    assert report_main([str(make(tmp_path))]) == 2  # what `ditrun report PATH` exits with
    assert capsys.readouterr().err == f"ditrun: error: {make(tmp_path)} {message}\n"


@pytest.mark.timeout(300)
def test_a_run_of_picture_files_draws_its_edits_and_a_moved_picture_leaves_a_blank_cell(tmp_path):
    """edits.png for references given as files (records name them by absolute path) and as skimage pictures;
    a picture moved away later leaves its cell blank, and the report still ends well."""
    from skimage import data

    io.imsave(tmp_path / "cat.png", data.chelsea()[::4, ::4])
    manifest = tmp_path / "edits.yaml"
    manifest.write_text(
        json.dumps(
            [
                {"id": "cat", "image": "cat.png", "prompt": "make it black and white", "target": "grayscale"},
                {"id": "rocket", "image": "skimage:rocket", "prompt": "invert the colours"},
            ]
        )
    )
    run_dir = tmp_path / "run"
    done = ditrun(
        *TINY,
        f"workload.manifest={manifest}",
        "metrics.ssim=false",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run_dir / "edits.jsonl").read_text().splitlines()]
    assert [r["reference"] for r in records] == [str(tmp_path / "cat.png"), "skimage:rocket"]
    _chart_ok(run_dir / "edits.png")
    assert "edits.png" in (run_dir / "report.md").read_text()

    (tmp_path / "cat.png").rename(tmp_path / "moved.png")
    (run_dir / "edits.png").unlink()
    assert report_main([str(run_dir)]) == 0
    _chart_ok(run_dir / "edits.png")
