"""A results directory lets nothing in: a symbolic link planted where a run writes, locks or reads (the lock,
the records, ``run.json``, ``images/``, ``latents/``, a temporary's name, the directory itself), and a directory
or entry of another user, lead to a one-sentence refusal before anything is written, or to a write that replaces
the link; the file outside is unchanged (its sha256 before and after). The copy engine's shared-memory regions
are this user's alone (0600)."""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ditrun_cli import TINY, ditrun
from tiers import missing

from ditrun.errors import UserError
from ditrun.results import files, rundir
from ditrun.transport import shared_memory

OTHER_USER = "ditrun-trust-other"
RECORD = '{"edit": "victim"}\n'


@pytest.fixture
def victim(tmp_path) -> Path:
    """Another user's files, out of the run directory: a file, an empty log, a folder."""
    home = tmp_path / "victim"
    (home / "outside").mkdir(parents=True)
    (home / "important.txt").write_text("the victim's own words\n")
    (home / "empty.log").write_text("")
    (home / "outside" / "mine.png").write_bytes(b"the victim's picture")
    return home


def checksums(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with its sha256: a new file shows as well as a changed one."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def planted(out: Path, name: str, target: Path) -> Path:
    out.mkdir(exist_ok=True)
    (out / name).symlink_to(target)
    return out / name


TARGETS = {  # what a planted link at each name points at
    rundir.LOCK_FILE: "important.txt",
    files.EDITS_FILE: "empty.log",
    "edits.replica1.jsonl": "empty.log",
    rundir.REJECTED_FILE: "empty.log",
    files.RUN_FILE: "important.txt",
    files.SUMMARY_FILE: "important.txt",
    files.IMAGES_DIR: "outside",
    files.LATENTS_DIR: "outside",
    rundir.HYDRA_DIR: "outside",
    files.WANDB_DIR: "outside",
}


@pytest.mark.parametrize("name", TARGETS)
def test_a_planted_link_is_refused_in_one_sentence_before_anything_is_written(tmp_path, victim, name):
    out, before = tmp_path / "run", checksums(victim)
    planted(out, name, victim / TARGETS[name])
    with pytest.raises(UserError) as refused:
        rundir.make_run_dir(out)
    assert str(refused.value).startswith(f"{out / name} is a symbolic link owned by root, ")
    assert "no symbolic links" in str(refused.value) and "\n" not in str(refused.value)
    assert checksums(victim) == before and sorted(p.name for p in out.iterdir()) == [name]


def test_the_run_directory_itself_as_a_link_is_refused(tmp_path, victim):
    before = checksums(victim)
    out = tmp_path / "run"
    out.symlink_to(victim / "outside")
    with pytest.raises(UserError, match=f"^{out} is a symbolic link owned by root"):
        rundir.make_run_dir(out)
    assert checksums(victim) == before


def test_every_opener_refuses_a_link_even_past_the_directory_check(tmp_path, victim):
    """The check at the start is one sentence; ``O_NOFOLLOW`` on every open is what holds all the same (a link
    planted after the check): the lock, a record's append, the records read at recovery."""
    out, before = tmp_path / "run", checksums(victim)
    planted(out, rundir.LOCK_FILE, victim / "important.txt")
    planted(out, files.EDITS_FILE, victim / "empty.log")
    (victim / "empty.log").write_text(RECORD)  # a record the run must not adopt
    before = checksums(victim)
    with pytest.raises(UserError, match="is a symbolic link"):
        rundir.RunLock(out).acquire()
    with pytest.raises(UserError, match="is a symbolic link"):
        files.append_record(out / files.EDITS_FILE, {"edit": "e"})
    for read in (rundir.recover, rundir.found_records, files.finished_edits):
        with pytest.raises(UserError, match="is a symbolic link"):
            read(out)
    assert checksums(victim) == before


def test_whole_file_writes_replace_a_planted_link_and_never_write_through_it(tmp_path, victim):
    out, before = tmp_path / "run", checksums(victim)
    link = planted(out, files.RUN_FILE, victim / "important.txt")
    files.write_json(link, {"mine": True})
    assert not link.is_symlink() and link.read_text() == '{\n  "mine": true\n}'
    assert checksums(victim) == before


def test_a_chart_replaces_a_planted_link(tmp_path, victim):
    """The report's charts go through ``files.write_file`` too (``savefig`` on a path would write through it)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    out, before = tmp_path / "run", checksums(victim)
    link = planted(out, "dit_time.png", victim / "important.txt")
    fig = plt.figure(figsize=(1, 1))
    files.save_figure(fig, link)
    plt.close(fig)
    assert not link.is_symlink() and link.read_bytes().startswith(b"\x89PNG")
    assert checksums(victim) == before


def test_an_output_folder_that_is_a_link_is_refused_and_nothing_lands_outside(tmp_path, victim):
    out, before = tmp_path / "run", checksums(victim)
    planted(out, files.IMAGES_DIR, victim / "outside")
    with pytest.raises(UserError, match=f"^{out / files.IMAGES_DIR} is a symbolic link"):
        files.save_png(np.zeros((4, 4, 3), np.uint8), files.output_path(out, "images/e.png"))
    assert checksums(victim) == before


def test_an_output_folder_is_made_a_real_folder_and_a_file_in_its_place_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    files.output_path(out, "latents/e.latents.safetensors")
    assert stat.S_ISDIR(os.lstat(out / files.LATENTS_DIR).st_mode)
    (out / files.IMAGES_DIR).write_text("a file")
    with pytest.raises(UserError, match=f"^{out / files.IMAGES_DIR} is a file, not a folder, owned by root"):
        files.output_path(out, "images/e.png")


def test_a_temporary_has_an_unguessable_name_and_is_never_opened_through_a_link(tmp_path, victim, monkeypatch):
    out, before = tmp_path / "run", checksums(victim)
    out.mkdir()
    names = set()
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda tmp, path: names.add(Path(tmp).name) or real_replace(tmp, path))
    files.write_file(out / "a.json", b"1")
    files.write_file(out / "a.json", b"2")
    assert len(names) == 2 and all(name.startswith(files.TEMPORARY_PREFIX) for name in names)
    # A name guessed all the same (the random part fixed here) and planted is not written through.
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "guessed")
    planted(out, f"{files.TEMPORARY_PREFIX}guessed.a.json", victim / "important.txt")
    with pytest.raises(FileExistsError):
        files.write_file(out / "a.json", b"3")
    assert checksums(victim) == before and (out / "a.json").read_bytes() == b"2"


def test_recovery_removes_planted_temporaries_themselves_and_never_looks_through_a_linked_folder(tmp_path, victim):
    out = tmp_path / "run"
    (victim / "outside" / f"{files.TEMPORARY_PREFIX}x.png").write_bytes(b"the victim's, by that name")
    before = checksums(victim)
    link = planted(out, f"{files.TEMPORARY_PREFIX}planted.json", victim / "important.txt")
    planted(out, files.IMAGES_DIR, victim / "outside")
    assert rundir.recover(out) == []
    assert not link.is_symlink() and checksums(victim) == before


def test_a_record_whose_output_is_a_link_is_redone_not_read(tmp_path, victim):
    out = tmp_path / "run"
    (out / files.IMAGES_DIR).mkdir(parents=True)
    (out / files.IMAGES_DIR / "e.png").symlink_to(victim / "outside" / "mine.png")
    record = {"edit": "e", **files.edit_outputs("e"), "sha256": {"image": "0", "latents": "0"}}
    assert rundir.output_problem(out, record) == "images/e.png is not a file"


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    """A second user of this machine, made for these tests (and removed after them)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        missing("second-user", "making a second user needs root and useradd")
    made = subprocess.run(["useradd", "--no-create-home", OTHER_USER], capture_output=True, text=True)
    if made.returncode not in (0, 9):  # 9: it exists (left by an interrupted session)
        missing("second-user", f"useradd failed: {made.stderr.strip()}")
    yield pwd.getpwnam(OTHER_USER)
    if made.returncode == 0:
        subprocess.run(["userdel", OTHER_USER], capture_output=True)


@pytest.mark.parametrize("name", ["", files.EDITS_FILE, rundir.LOCK_FILE, files.IMAGES_DIR, "edits.replica1.jsonl"])
def test_a_directory_or_entry_of_another_user_is_refused_naming_its_owner(tmp_path, other_user, name):
    out = tmp_path / "run"
    out.mkdir()
    entry = out / name
    if name == files.IMAGES_DIR:
        entry.mkdir()
    elif name:
        entry.write_text(RECORD)
    os.chown(entry, other_user.pw_uid, other_user.pw_gid)
    before = checksums(out)
    with pytest.raises(UserError) as refused:
        rundir.make_run_dir(out)
    assert str(refused.value).startswith(f"{entry} is a ") and f" owned by {OTHER_USER}, " in str(refused.value)
    assert checksums(out) == before


def test_a_shared_memory_region_is_this_users_alone(monkeypatch):
    """The copy engine's region is made 0600, whatever the umask: no other user can map the activations."""
    modes = []

    def gather(names, path, group):  # one rank: what every rank's gather would see of this file
        modes.append(stat.S_IMODE(os.stat(path).st_mode))
        names[:] = [path]

    monkeypatch.setattr(shared_memory.dist, "all_gather_object", gather)
    monkeypatch.setattr(shared_memory.dist, "barrier", lambda group: None)
    old_umask = os.umask(0)
    try:
        region = shared_memory.SharedMemoryFabric(1.0).map(4096, None, [True], 1)
    finally:
        os.umask(old_umask)
    assert modes == [0o600] and region.bytes(0).numel() == 4096


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [rundir.LOCK_FILE, "__main__.log", ""])
def test_the_command_refuses_a_planted_link_and_leaves_the_file_outside_unchanged(tmp_path, victim, name):
    """Through the real command: a lock or Hydra's log planted as a link to another's file, or a run directory that
    is a link (Hydra's log, opened before ditrun's checks, refuses it first)."""
    out = tmp_path / "run"
    if name:
        planted(out, name, victim / "important.txt")
    else:
        out.symlink_to(victim / "outside")
    before = checksums(victim)
    run = ditrun(*TINY, "wandb.mode=disabled", "progress=false", f"hydra.run.dir={out}", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert f"ditrun: error: {out / name if name else out} is a symbolic link owned by root" in run.stderr
    assert run.stderr.count("ditrun: error:") == 1 and "Traceback" not in run.stderr
    assert checksums(victim) == before


def test_recovery_passes_over_a_temporary_that_vanishes_while_it_looks(tmp_path, monkeypatch):
    """Rank 0 recovers the directory while another rank's probe of it (``run/folders.py``) comes and goes under the
    temporary prefix: a name listed, then gone before it is looked at, is no error (a 4-rank run failed on one)."""
    out = tmp_path / "run"
    out.mkdir()
    gone, left = out / f"{files.TEMPORARY_PREFIX}probe.0", out / f"{files.TEMPORARY_PREFIX}left.json"
    gone.write_text("\n")
    left.write_text("{}")
    listed = Path.glob

    def glob_then_remove(folder, pattern, **kwargs):
        names = list(listed(folder, pattern, **kwargs))
        if pattern.startswith(files.TEMPORARY_PREFIX) and gone in names:
            gone.unlink()  # the other rank removes its probe after the listing
        return names

    monkeypatch.setattr(Path, "glob", glob_then_remove)
    assert rundir.recover(out) == []
    assert not gone.exists() and not left.exists()
