"""What a node does to a run, through the real command: a results disk that fills up at several points of a run
(a small tmpfs), cache folders that cannot be written (mode 555), a HOME that is ``/`` or unset. Each ends as
``run/folders.py`` says: one ``ditrun: error:`` sentence (exit 2) before the directory is claimed, the end of a
stop (resume line, exit 1) after it, a warning for a picture or a cache that moves into the run directory; never a
traceback, and a rerun once the disk has room completes every edit once."""

import errno
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from ditrun_cli import TINY, ditrun, full_quality_dir
from tiers import missing

pytestmark = pytest.mark.slow

RUN = [*TINY, "wandb.mode=disabled"]
# As root, without the capabilities that let root write any folder: a folder of mode 555 refuses it as it would a user.
NO_OVERRIDE = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")
PAGE = 4096  # a tmpfs gives files whole pages


def _mount_tmpfs(folder: Path, size: str) -> None:
    """A tmpfs of ``size`` at ``folder`` (root only: the test is skipped elsewhere, failed under CI)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, timeout=30
    )
    if mounted.returncode != 0:
        missing("tmpfs", f"mounting a tmpfs needs root: {mounted.stderr.decode().strip()}")


@pytest.fixture
def mounts():
    """Mount tmpfs folders for a test (``mounts(folder, size)``); each is unmounted (lazily, so a process still
    inside cannot keep it) at the end, however the test ended."""
    made: list[Path] = []

    def mount(folder: Path, size: str = "4m") -> Path:
        _mount_tmpfs(folder, size)
        made.append(folder)
        return folder

    yield mount
    for folder in reversed(made):
        subprocess.run(["umount", "-l", str(folder)], check=False, capture_output=True, timeout=30)


def _fill(disk: Path, free: int) -> None:
    """Leave ``free`` bytes of ``disk`` unused, whatever it holds now (a filler file takes the rest)."""
    (disk / "filler").unlink(missing_ok=True)
    avail = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as file:
        os.posix_fallocate(file.fileno(), 0, avail - free)


def _pages(path: Path) -> int:
    """The bytes ``path`` takes on its disk (whole pages on a tmpfs)."""
    return path.stat().st_blocks * 512


def _records(run_dir: Path) -> list[str]:
    return [json.loads(line)["edit"] for line in (run_dir / "edits.jsonl").read_text().splitlines()]


def _no_traceback(proc) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr


def _ended_as_a_stop(proc, run_dir: Path, done: int, edits: int, path: Path) -> None:
    """What a run that the disk refused mid-run ends with: the resume line for the finished edits on stdout, one
    ``ditrun: error:`` sentence naming the file, exit 1, no traceback."""
    _no_traceback(proc)
    assert proc.returncode == 1, proc.stderr
    if done:
        assert f"{done} of {edits} edits are in {run_dir / 'edits.jsonl'}; rerun the same command" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ditrun: error:")]
    assert len(errors) == 1 and f"{path}" in errors[0] and "No space left on device" in errors[0], proc.stderr
    assert errors[0].endswith(f"rerun the same command to resume (results: {run_dir})"), errors[0]


@pytest.mark.timeout(300)
def test_a_results_disk_filled_at_each_point_of_a_run(mounts, tmp_path, tmp_path_factory):
    """A full results disk before the claim refuses the run (one sentence, exit 2, nothing written); one that fills
    at the claim ends it as a stop does (exit 1); the rerun on a disk with room for everything but the report's
    pictures completes every edit once, each picture that does not fit a warning. (The edit loop's point is the
    two-rank test below: the same code.)"""
    disk = mounts(tmp_path / "disk")
    refs = f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}"
    run_dir = disk / "run"
    whole = ditrun(*RUN, refs, f"hydra.run.dir={run_dir}", cwd=tmp_path)  # to measure a whole run's files
    assert whole.returncode == 0, whole.stderr
    edits = _records(run_dir)
    pictures = sum(_pages(p) for p in run_dir.glob("*.png")) + _pages(run_dir / "report.md")
    without_pictures = sum(_pages(p) for p in run_dir.rglob("*") if p.is_file()) - pictures
    claim_files = _pages(run_dir / ".ditrun.lock") + _pages(run_dir / "run.json")  # the claim's first files
    shutil.rmtree(run_dir)

    _fill(disk, 0)  # before the claim: the probe of the results directory fails
    proc = ditrun(*RUN, refs, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    _no_traceback(proc)
    assert (proc.returncode, proc.stderr) == (
        2,
        f"ditrun: error: the results directory {run_dir} cannot be written (No space left on device); free "
        "space there, or set hydra.run.dir (or output_dir) to a folder with room.\n",
    )
    assert not run_dir.exists()  # not even the folder Hydra made for it

    _fill(disk, claim_files)  # at the claim: Hydra's files do not fit
    proc = ditrun(*RUN, refs, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    _ended_as_a_stop(proc, run_dir, 0, len(edits), run_dir / ".hydra")

    # The same command with room for all but the pictures (and a page or two for the claim's files it replaces).
    in_use = sum(_pages(p) for p in run_dir.rglob("*") if p.is_file())
    _fill(disk, without_pictures - in_use + 2 * PAGE)
    proc = ditrun(*RUN, refs, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    assert "was not drawn (OSError: [Errno 28] No space left on device" in proc.stderr, proc.stderr
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True
    assert sorted(_records(run_dir)) == sorted(edits)  # every edit once


@pytest.mark.timeout(300)
def test_two_ranks_whose_results_disk_fills_after_the_first_edit(mounts, tmp_path, tmp_path_factory):
    """Two ranks (ulysses), the disk of the run's latents with room for one edit's: rank 0, which writes, finds the
    disk full at the second edit; both ranks stop together at the next stop point (no rank waits for the other), the
    second edit's other file is removed, and the run ends as a stop does: summary.json (complete: false) for the
    first edit, the resume line, one sentence naming the file, exit 1. Once the disk has room, the same command
    completes every edit once."""
    run_dir = tmp_path / "run"
    latents = mounts(run_dir / "latents", "1m")  # a disk of its own, filling up after the first edit
    command = [
        *RUN,
        "launcher.world=2",
        "layout=ulysses",
        f"metrics.full_quality_dir={full_quality_dir(tmp_path_factory)}",
    ]
    _fill(latents, PAGE)  # one edit's latents (a kilobyte) fit
    proc = ditrun(*command, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    _ended_as_a_stop(proc, run_dir, 1, 2, latents)
    (first,) = _records(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["complete"], summary["edits"], summary["world"]) == (False, 1, 2)
    assert [p.name for p in (run_dir / "images").iterdir()] == [f"{first}.png"]  # the second edit left no file

    (latents / "filler").unlink()
    again = ditrun(*command, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    _no_traceback(again)
    assert again.returncode == 0, again.stderr
    assert len(_records(run_dir)) == 2 and _records(run_dir)[0] == first  # every edit once
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True


@pytest.mark.timeout(200)
def test_caches_whose_disks_fill_mid_run_are_a_warning_each(mounts, tmp_path):
    """The reference cache and the prompt cache (a pipeline folder's encoded prompts) each on a disk of its own, with
    room for the probe before the claim and not for an entry: one warning for each, and the run completes. The run
    goes on without storing references (each edit still scored against its own); the encoded prompts are files every
    rank reads, so they move into the run directory. Nothing half-written stays in either cache."""
    refs, prompts = mounts(tmp_path / "refs", "1m"), mounts(tmp_path / "prompts", "1m")
    _fill(refs, PAGE)
    _fill(prompts, PAGE)
    run_dir = tmp_path / "run"
    proc = ditrun(
        "model=editor",
        "workload.limit=1",
        "workload.steps=2",
        "metrics.report=false",
        "wandb.mode=disabled",
        f"metrics.full_quality_dir={refs}",
        f"workload.prompt_cache_dir={prompts}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("ditrun: warning:")]
    assert len(warned) == 2, proc.stderr
    moved, unstored = sorted(warned, key=lambda line: "reference" in line)
    assert moved.startswith(f"ditrun: warning: the prompt cache {prompts} cannot be written (No space left on")
    assert f"keeps its encoded prompts in {run_dir / 'cache' / 'prompts'}" in moved
    assert unstored.startswith(f"ditrun: warning: the reference cache {refs} cannot be written (No space left on")
    assert "metrics.full_quality_dir" in unstored
    (record,) = [json.loads(line) for line in (run_dir / "edits.jsonl").read_text().splitlines()]
    assert record["ssim"] is not None
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True
    assert list((run_dir / "cache" / "prompts").glob("*.safetensors"))
    assert [p.name for p in refs.iterdir()] == ["filler"] and [p.name for p in prompts.iterdir()] == ["filler"]


@pytest.fixture
def work():
    """A folder below /tmp, which another user can pass through (unlike pytest's folders)."""
    folder = Path(tempfile.mkdtemp())
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _as_nobody() -> tuple[str, ...]:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        missing("second-user", "running as another user needs root and setpriv")
    return ("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("home", ["555", "/", None])
def test_caches_that_cannot_be_written_move_into_the_run_directory(tmp_path, work, home):
    """The reference cache, W&B's folders and matplotlib's, under a cache folder of mode 555, a HOME of ``/`` (as a
    user who cannot write there), or no HOME at all: the run completes with one warning naming them and where they
    went, the references made in the run directory; W&B's offline run is finished."""
    env, unset, prefix = (
        {},
        # (and the test process's compiler folders, which a run of another user may not use)
        ["XDG_", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "MPLCONFIGDIR", "TORCHINDUCTOR_", "TRITON_"],
        NO_OVERRIDE,
    )
    if home == "555":
        cache = tmp_path / "cache"
        cache.mkdir(mode=0o555)
        env = {"XDG_CACHE_HOME": str(cache), "XDG_CONFIG_HOME": str(cache), "XDG_DATA_HOME": str(cache)}
        unset.remove("XDG_")
        if os.geteuid() != 0:
            prefix = ()
    else:
        prefix = _as_nobody()
        os.chown(work, 65534, 65534)
        if home is None:
            unset.append("HOME")
        else:
            env = {"HOME": home}
    run_dir = work / "run"
    proc = ditrun(
        *TINY, "wandb.mode=offline", f"hydra.run.dir={run_dir}", cwd=work, env=env, unset=unset, prefix=prefix
    )
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    moved = [line for line in proc.stderr.splitlines() if "this run keeps" in line]
    assert len(moved) == 1 and "the reference cache" in moved[0] and f"{run_dir / 'cache'}" in moved[0]
    assert "metrics.full_quality_dir" in moved[0] and "WANDB_DATA_DIR" in moved[0]
    assert any((run_dir / "cache" / "references").iterdir())
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_a_results_directory_that_cannot_be_written_is_one_sentence_and_a_cache_moves(tmp_path, monkeypatch):
    """Where nothing can move, one sentence naming the folder and the keys that move it; a cache the user named
    that cannot be written moves into the run directory, its key set there."""
    from omegaconf import OmegaConf

    from ditrun.errors import UserError
    from ditrun.run import folders

    cfg = OmegaConf.create({"metrics": {"ssim": True, "full_quality_dir": str(tmp_path / "refs"), "report": False}})
    cfg.model = {"path": None}

    def read_only(name):
        return lambda path: OSError(errno.EROFS, "Read-only file system", str(path)) if path.name == name else None

    monkeypatch.setattr(folders, "_probe", read_only("run"))
    with pytest.raises(UserError, match=r"the results directory cannot be written \(Read-only file system: .*/run\)"):
        folders.check_run_folders(cfg, tmp_path / "run", wandb_on=False)
    monkeypatch.setattr(folders, "_probe", read_only("refs"))
    folders.check_run_folders(cfg, tmp_path / "run", wandb_on=False)
    assert cfg.metrics.full_quality_dir == str(tmp_path / "run" / "cache" / "references")


def test_a_refused_run_leaves_nothing_behind(tmp_path):
    """A run refused before it starts (here a config mistake) removes the folder Hydra made for it, and only that:
    a folder the user made beforehand stays."""
    made_by_user = tmp_path / "mine"
    made_by_user.mkdir()
    for run_dir in (tmp_path / "new" / "run", made_by_user):
        proc = ditrun(*TINY, "workload.limit=0", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith("ditrun: error: workload.limit=0"), proc.stderr
    assert not (tmp_path / "new" / "run").exists() and made_by_user.is_dir() and not any(made_by_user.iterdir())
