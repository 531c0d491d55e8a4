"""What a node does to a run, through the real command: a results disk that fills up at several points of a run
(a small tmpfs), cache folders that cannot be written (mode 555), a HOME that is ``/`` or unset. Each ends as
``launch/folders.py`` says: one ``ditrun: error:`` sentence (exit 2) before the directory is claimed, the end of a
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
from ditrun_cli import TINY, ditrun, reference_dir
from tiers import missing

pytestmark = pytest.mark.slow

RUN = [*TINY, "wandb.mode=disabled"]
# As root, without the capabilities that let root write any folder: a folder of mode 555 refuses it as it would a user.
NO_OVERRIDE = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")
# Free bytes left on the results disk: none (the probe before the claim fails), then points inside the edits, at the
# summary, and at the charts, found by measuring a whole run of TINY on this machine.
PAGE = 4096


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, mounted for the test (root only)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        missing("tmpfs", f"mounting a tmpfs needs root: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path, free: int) -> None:
    """Leave ``free`` bytes of ``disk`` unused (a filler file takes the rest)."""
    (disk / "filler").unlink(missing_ok=True)
    avail = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as file:
        file.truncate(0)
        os.posix_fallocate(file.fileno(), 0, avail - free)


def _records(run_dir: Path) -> list[str]:
    return [json.loads(line)["edit"] for line in (run_dir / "edits.jsonl").read_text().splitlines()]


def _no_traceback(proc) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr


@pytest.mark.timeout(600)
def test_a_results_disk_filled_at_each_point_of_a_run(small_disk, tmp_path, tmp_path_factory):
    """Free space of 0 bytes refuses the run before the claim; a disk that fills inside the edits or at the summary
    ends it as a stop does (exit 1, the resume line); one that fills at the charts warns and completes. After each,
    the same command on a disk with room completes every edit exactly once."""
    refs = f"metrics.reference_dir={reference_dir(tmp_path_factory)}"
    run_dir = small_disk / "run"
    whole = ditrun(*RUN, refs, f"hydra.run.dir={run_dir}", cwd=tmp_path)  # measure a whole run, and make references
    assert whole.returncode == 0, whole.stderr
    used = 4 * 2**20 - shutil.disk_usage(small_disk).free
    edits = _records(run_dir)
    outcomes = set()
    for free in (0, used // 6, used // 3, used // 2, used - 4 * PAGE):
        shutil.rmtree(run_dir, ignore_errors=True)
        _fill(small_disk, free - free % PAGE)
        proc = ditrun(*RUN, refs, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        _no_traceback(proc)
        if proc.returncode == 2:  # refused before the claim: one sentence, nothing of the run written
            assert proc.stderr == (
                f"ditrun: error: the results directory {run_dir} cannot be written (No space left on device); free "
                "space there, or set hydra.run.dir (or output_dir) to a folder with room.\n"
            )
            assert not run_dir.exists()  # not even the folder Hydra made for it
        elif proc.returncode == 1:  # after the claim: what a stop writes, where the disk allowed
            done = len(_records(run_dir)) if (run_dir / "edits.jsonl").exists() else 0
            said = f"{done} of {len(edits)} edits are in {run_dir / 'edits.jsonl'}; rerun the same command"
            assert said in proc.stdout or done == 0, proc.stdout  # a claim the disk refused ran no edit
            assert "ditrun: stopped: No space left on device" in proc.stderr
            assert f"rerun the same command to resume (results: {run_dir})" in proc.stderr
        else:  # only a picture of the report did not fit: a warning, the run is whole
            assert proc.returncode == 0, proc.stderr
            assert json.loads((run_dir / "summary.json").read_text())["complete"] is True
        outcomes.add(proc.returncode)
        (small_disk / "filler").unlink()
        if proc.returncode == 1:
            again = ditrun(*RUN, refs, f"hydra.run.dir={run_dir}", cwd=tmp_path)
            assert again.returncode == 0, again.stderr
            assert sorted(_records(run_dir)) == sorted(edits)  # every edit once
    assert {1, 2} <= outcomes, outcomes


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
    assert "metrics.reference_dir" in moved[0] and "WANDB_DATA_DIR" in moved[0]
    assert any((run_dir / "cache" / "references").iterdir())
    assert json.loads((run_dir / "summary.json").read_text())["complete"] is True
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_a_results_directory_that_cannot_be_written_is_one_sentence_and_a_cache_moves(tmp_path, monkeypatch):
    """Where nothing can move, one sentence naming the folder and the keys that move it; a cache the user named
    that cannot be written moves into the run directory, its key set there."""
    from omegaconf import OmegaConf

    from ditrun.errors import UserError
    from ditrun.launch import folders

    cfg = OmegaConf.create({"metrics": {"ssim": True, "reference_dir": str(tmp_path / "refs"), "report": False}})
    cfg.model = {"path": None}

    def read_only(name):
        return lambda path: OSError(errno.EROFS, "Read-only file system", str(path)) if path.name == name else None

    monkeypatch.setattr(folders, "_probe", read_only("run"))
    with pytest.raises(UserError, match=r"the results directory cannot be written \(Read-only file system: .*/run\)"):
        folders.check_run_folders(cfg, tmp_path / "run", wandb_on=False)
    monkeypatch.setattr(folders, "_probe", read_only("refs"))
    folders.check_run_folders(cfg, tmp_path / "run", wandb_on=False)
    assert cfg.metrics.reference_dir == str(tmp_path / "run" / "cache" / "references")


def test_a_refused_run_leaves_nothing_behind(tmp_path):
    """A run refused before it starts (here a config mistake) removes the folder Hydra made for it, and only that:
    a folder the user made beforehand stays."""
    made_by_user = tmp_path / "mine"
    made_by_user.mkdir()
    for run_dir in (tmp_path / "new" / "run", made_by_user):
        proc = ditrun(*TINY, "workload.limit=0", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith("ditrun: error: workload.limit=0"), proc.stderr
    assert not (tmp_path / "new" / "run").exists() and made_by_user.is_dir() and not any(made_by_user.iterdir())
