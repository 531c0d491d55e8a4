"""``ditrun report`` over a tree another user (or a broken disk) could have made: links to devices, FIFOs, huge
sparse files, JSON nested past any parser's recursion, folders it cannot list. Each bad run directory is one line
of the report, the good ones are reported, and the command stays within a memory limit and a time limit."""

import json
import os
import shutil
from pathlib import Path

import pytest
from ditrun_cli import TINY, ditrun
from test_report import _fake_run

pytestmark = pytest.mark.slow

MEMORY_LIMIT = 3 << 30  # address space, bytes: the report imports matplotlib and numpy; /dev/zero alone would pass it
TIMEOUT_S = 120  # a FIFO read would wait forever


def _limited() -> tuple[str, ...]:
    """``ditrun report`` under an address-space limit and, as root, without the capabilities that let root list any
    folder (so a folder of mode 000 is as unreadable as it is to a user)."""
    prefix = ("prlimit", f"--as={MEMORY_LIMIT}", "--")
    if os.geteuid() == 0 and shutil.which("setpriv"):
        prefix = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *prefix)
    return prefix


def _hostile_tree(root: Path) -> dict[str, str]:
    """A sweep of two good runs and one bad run per hostile entry; returns each bad run's label -> what the report
    must say of it."""
    _fake_run(root / "good1", "single", "bf16", 1, dit_s=6.0, exposed_s=0.0, ssim=0.99)
    _fake_run(root / "good2", "ulysses", "bf16", 2, dit_s=3.0, exposed_s=0.5, ssim=0.98)
    bad = {}
    _fake_run(root / "zero", "single", "bf16", 1, dit_s=1.0, exposed_s=0.0, ssim=0.9)
    (root / "zero" / "summary.json").unlink()
    (root / "zero" / "summary.json").symlink_to("/dev/zero")
    bad["zero"] = "summary.json is a symbolic link"
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "run.json")
    bad["fifo"] = "run.json is a FIFO"
    _fake_run(root / "sparse", "single", "bf16", 1, dit_s=1.0, exposed_s=0.0, ssim=0.9)
    with open(root / "sparse" / "summary.json", "r+b") as file:
        file.truncate(2 << 30)  # 2 GiB of holes: no disk, all memory if read
    bad["sparse"] = "summary.json is larger than"
    _fake_run(root / "deep", "single", "bf16", 1, dit_s=1.0, exposed_s=0.0, ssim=0.9)
    (root / "deep" / "summary.json").write_text("[" * 200_000 + "]" * 200_000)
    bad["deep"] = "summary.json is not a JSON object"
    _fake_run(root / "deep_record", "single", "bf16", 1, dit_s=2.0, exposed_s=0.0, ssim=0.95)
    with open(root / "deep_record" / "edits.jsonl", "a") as file:
        file.write('{"edit": "b", "ssim": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    (root / "locked").mkdir()
    (root / "locked" / "summary.json").write_text("{}")
    (root / "locked").chmod(0)
    bad["locked"] = "cannot be listed (Permission denied)"
    return bad


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_report_of_a_hostile_tree_names_each_bad_run_within_memory_and_time(tmp_path):
    sweep = tmp_path / "sweep"
    bad = _hostile_tree(sweep)
    try:
        proc = ditrun("report", str(sweep), cwd=tmp_path, prefix=_limited(), timeout=TIMEOUT_S)
    finally:
        (sweep / "locked").chmod(0o700)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for label, reason in bad.items():
        named = [line for line in lines if line.startswith(f"Not judged: `{label}`")]
        assert len(named) == 1 and reason in named[0], (label, proc.stdout)
    # The good runs, and the one whose bad line is only skipped, are rows of the table with their numbers.
    rows = {line.split()[0]: line for line in lines[1:] if line and not line.startswith(("Not judged", "Quality"))}
    assert "6.0000" in rows["good1"] and "3.0000" in rows["good2"] and "2.0000" in rows["deep_record"]
    markdown = (sweep / "report.md").read_text()
    assert all(f"`{label}`: **unreadable**" in markdown for label in bad)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_runs_own_pictures_that_are_not_files_leave_blank_cells(tmp_path):
    """The picture of one run's edits reads its output only as the run's own regular file, and a reference named
    by the record only once it is known to be a picture file: a FIFO and /dev/zero there are not read."""
    run = tmp_path / "run"
    _fake_run(run, "single", "bf16", 1, dit_s=1.0, exposed_s=0.0, ssim=0.9)
    record = json.loads((run / "edits.jsonl").read_text())
    record.update(image="images/a.png", reference="/dev/zero", width=32, height=32)
    record["settings"] = {"edit": {"prompt": "p"}}
    (run / "edits.jsonl").write_text(json.dumps(record) + "\n")
    (run / "images").mkdir()
    os.mkfifo(run / "images" / "a.png")
    proc = ditrun("report", str(run), cwd=tmp_path, prefix=_limited(), timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "edits.png was not drawn" in proc.stderr and "FIFO" in proc.stderr
    assert (run / "report.md").is_file() and not (run / "edits.png").exists()


@pytest.mark.timeout(TIMEOUT_S)
def test_a_fifo_planted_as_run_json_refuses_the_run_before_it_starts(tmp_path):
    """The run reads its ``run.json`` and ``summary.json`` as the report does: a FIFO there is refused up front
    (one sentence, exit 2, nothing written) instead of a read that never ends."""
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "run.json")
    proc = ditrun(*TINY, "wandb.mode=disabled", f"hydra.run.dir={run}", cwd=tmp_path, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"ditrun: error: {run / 'run.json'} is a FIFO owned by"), proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]
