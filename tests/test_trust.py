"""Trust for caches that hold code (``ditrun/trust.py``): the compile cache's entries, Inductor's and Triton's folders.

Everything here is done as two real users of this machine: the test's (root, which may ``useradd``) and a second
user it creates, in a team group of its own. Files are the real thing, with real owners and modes (``chown`` to
the second user); the processes of the second user run under its uid (``setpriv``). The second user keeps one
capability, reading any file (``CAP_DAC_READ_SEARCH``): this venv's interpreter lives under root's 0700 home.
What it writes is its own and every write is checked as its own, which is all a planted file needs.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from launching import ditrun_command, quiet_env
from tiers import missing

from ditrun.errors import UserError
from ditrun.model.compile import INDUCTOR_CACHE_ENV, TRITON_CACHE_ENV, claim_compiler_caches
from ditrun.run.compile_cache import (
    ENTRY_SUFFIX,
    TRUST_KEY,
    CompileCache,
    Entry,
    kernel_folders,
    read_entry,
    write_entry,
)
from ditrun.trust import Trust, Untrusted, private_folder, read_trusted, write_for

JOB = Path(__file__).with_name("compile_cache_job.py")
JOB_TIMEOUT_S = 240


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    team: str
    """A group of its own that the user is a member of (not its primary group)."""
    team_gid: int


@pytest.fixture(scope="module")
def other() -> User:
    """A second user of this machine, in a team group; both removed afterwards."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        missing("second-user", "needs root, useradd and setpriv to act as a second user of this machine")
    suffix = secrets.token_hex(3)
    name, team = f"ditrun-u{suffix}", f"ditrun-team{suffix}"
    subprocess.run(["groupadd", team], check=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", team, name], check=True)
    import grp
    import pwd

    user = pwd.getpwnam(name)
    yield User(name, user.pw_uid, user.pw_gid, team, grp.getgrnam(team).gr_gid)
    subprocess.run(["userdel", name], check=False)
    subprocess.run(["groupdel", team], check=False)


@pytest.fixture
def shared() -> Path:
    """A folder under /tmp that both users reach (pytest's own is root's, 0700); removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ditrun-trust-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _refusal(path: Path, root: Path, trust: Optional[Trust] = None) -> str:
    with pytest.raises(Untrusted) as why:
        read_trusted(path, root, trust or Trust())
    return str(why.value)


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


# ---------------------------------------------------------------------------------------------
# The check, on real files


def test_a_file_only_this_user_could_have_written_is_read_and_written_0600(shared):
    path = shared / "cache" / "entry"
    write_for(path, b"code", Trust())
    assert (_mode(path.parent), _mode(path), read_trusted(path, path.parent, Trust())) == (0o700, 0o600, b"code")
    assert [p.name for p in path.parent.iterdir()] == ["entry"]  # no temporary left
    path.chmod(0o644)  # others may read: still nobody else could have written it
    assert read_trusted(path, path.parent, Trust()) == b"code"


def test_what_another_user_could_have_written_is_refused_naming_file_owner_and_mode(shared, other):
    folder = shared / "cache"
    folder.mkdir(mode=0o755)
    path = folder / "entry"
    path.write_bytes(b"code")
    os.chown(path, other.uid, other.gid)
    assert _refusal(path, folder) == (
        f"{path} (owner {other.name}, group {other.name}, mode 0644): it belongs to a user this run does not trust"
    )
    assert read_trusted(path, folder, Trust(users=frozenset({other.uid}))) == b"code"  # named in the trust key
    os.chown(path, 0, other.team_gid)
    assert read_trusted(path, folder, Trust()) == b"code"  # root's, and only root may write it
    path.chmod(0o666)
    assert _refusal(path, folder).endswith("mode 0666): anyone may write it")
    path.chmod(0o664)
    assert _refusal(path, folder).endswith("mode 0664): its group, which this run does not trust, may write it")
    assert read_trusted(path, folder, Trust(group=other.team_gid)) == b"code"  # the trusted group may
    path.chmod(0o644)
    folder.chmod(0o777)  # anyone may put another file in its place
    assert _refusal(path, folder) == f"{folder} (owner root, group root, mode 0777): anyone may write it"
    folder.chmod(0o1777)  # sticky: only a file's owner may rename or remove it
    assert read_trusted(path, folder, Trust()) == b"code"


def test_a_trusted_groups_member_is_trusted_and_links_are_not_followed(shared, other):
    folder = shared / "team"
    folder.mkdir()
    os.chown(folder, other.uid, other.team_gid)
    folder.chmod(0o2770)
    path = folder / "entry"
    path.write_bytes(b"team code")
    os.chown(path, other.uid, other.team_gid)
    path.chmod(0o640)
    assert "it belongs to a user this run does not trust" in _refusal(path, folder)
    assert read_trusted(path, folder, Trust(group=other.team_gid)) == b"team code"
    link = folder / "link"
    link.symlink_to(path)
    assert _refusal(link, folder, Trust(group=other.team_gid)).endswith("is a symbolic link")
    below = folder / "below"
    below.symlink_to(shared, target_is_directory=True)  # a folder on the way that is a link, to one root owns
    (shared / "entry").write_bytes(b"x")
    assert "is not inside" in _refusal(below / "entry", folder, Trust(group=other.team_gid))
    with pytest.raises(FileNotFoundError):
        read_trusted(folder / "none", folder, Trust())


def test_the_trust_key_names_users_and_one_group(other):
    trust = Trust.parse([other.name, f"group:{other.team}", "0"], TRUST_KEY)
    assert trust == Trust(frozenset({other.uid, 0}), other.team_gid)
    assert (trust.file_mode, Trust().file_mode, Trust(frozenset({other.uid})).file_mode) == (0o640, 0o600, 0o644)
    with pytest.raises(UserError, match=f"^{TRUST_KEY} names user 'nobody-here-at-all', which this machine"):
        Trust.parse(["nobody-here-at-all"], TRUST_KEY)
    with pytest.raises(UserError, match=f"^{TRUST_KEY} names 2 groups; name one group"):
        Trust.parse([f"group:{other.team}", "group:root"], TRUST_KEY)
    assert Trust.parse(None, TRUST_KEY) == Trust() == Trust.parse([], TRUST_KEY)


def test_a_writer_for_a_trusted_group_gives_it_the_entry_and_the_folder(shared, other):
    trust = Trust(group=other.team_gid)
    path = shared / "made" / "entry"
    write_for(path, b"code", trust)
    folder = os.lstat(path.parent)
    assert (folder.st_gid, stat.S_IMODE(folder.st_mode)) == (other.team_gid, 0o2770)
    entry = os.lstat(path)
    assert (entry.st_uid, entry.st_gid, stat.S_IMODE(entry.st_mode)) == (0, other.team_gid, 0o640)
    write_for(path, b"again", trust)
    assert read_trusted(path, path.parent, trust) == b"again" and [p.name for p in path.parent.iterdir()] == ["entry"]


# ---------------------------------------------------------------------------------------------
# Inductor's and Triton's folders


def test_compiler_folders_default_to_the_users_cache_made_0700(tmp_path, monkeypatch):
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.delenv(TRITON_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folders = claim_compiler_caches()
    inductor = tmp_path / "cache" / "ditrun" / "inductor"
    assert folders == {INDUCTOR_CACHE_ENV: inductor, TRITON_CACHE_ENV: inductor / "triton"}
    assert os.environ[INDUCTOR_CACHE_ENV] == str(inductor) and os.environ[TRITON_CACHE_ENV] == str(inductor / "triton")
    assert [_mode(p) for p in (tmp_path / "cache", inductor, inductor / "triton")] == [0o700] * 3
    assert claim_compiler_caches() == folders  # the next process (a rank) checks what this one set


def test_a_compiler_folder_another_user_could_write_is_one_sentence(shared, other, monkeypatch):
    planted = shared / f"torchinductor_{other.name}"
    planted.mkdir()
    os.chown(planted, other.uid, other.gid)
    planted.chmod(0o777)
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(planted))
    with pytest.raises(UserError) as refused:
        claim_compiler_caches()
    assert str(refused.value) == (
        f"{INDUCTOR_CACHE_ENV}={planted} is a folder another user could have written ({planted} (owner "
        f"{other.name}, group {other.name}, mode 0777): it belongs to another user), and the compilers run the code "
        "they find there as you; name a folder only you can write, or remove or chmod go-w this one."
    )
    os.chown(planted, 0, 0)  # this user's, but anyone may write it
    with pytest.raises(UserError, match=r"mode 0777\): others may write it"):
        claim_compiler_caches()
    planted.chmod(0o700)
    mine = planted / "triton"
    mine.symlink_to(shared)
    monkeypatch.setenv(TRITON_CACHE_ENV, str(mine))
    with pytest.raises(UserError, match=r"is not a folder \(a link or a file\)"):
        claim_compiler_caches()
    open_folder = shared / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)  # a folder above: anyone may rename ours away and put theirs in its place
    monkeypatch.setenv(TRITON_CACHE_ENV, str(open_folder / "triton"))
    with pytest.raises(UserError, match=f"{open_folder} \\(owner root, group root, mode 0777\\): anyone may write"):
        claim_compiler_caches()


def test_private_folder_is_made_and_checked(shared, other):
    made = private_folder(shared / "a" / "b")
    assert made == shared / "a" / "b" and _mode(shared / "a") == _mode(made) == 0o700
    os.chown(made, other.uid, other.gid)
    with pytest.raises(Untrusted, match="it belongs to another user"):
        private_folder(made)


# ---------------------------------------------------------------------------------------------
# The compile cache sets aside what it cannot trust, and unpacks nothing of it


def _kernels_tar() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in (("__grp__k.json", b'{"child_paths": {}}'), ("k.source", b"print('planted')")):
            info = tarfile.TarInfo("a" * 52 + "/" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_an_entry_of_another_user_is_set_aside_with_one_warning_and_nothing_unpacked(shared, other, capsys):
    folder, node = shared / "cc", shared / "node-triton"
    cache = CompileCache(folder, {"model": "x"}, kernels_dir=node)
    write_entry(cache.path, cache.key, cache.described, Entry(b"", _kernels_tar()))
    os.chown(cache.path, other.uid, other.gid)
    assert cache.load() == "discarded" and cache.fields()["status"] == "discarded"
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert lines == [
        f"ditrun: warning: compile cache entry {cache.path} set aside: {cache.path} (owner {other.name}, group "
        f"{other.name}, mode 0600): it belongs to a user this run does not trust; compiling as without it (this "
        f"user, root and those {TRUST_KEY} names are trusted)"
    ]
    assert not node.exists()  # not even Triton's folder was made
    trusted = CompileCache(folder, {"model": "x"}, kernels_dir=node, trust=Trust(users=frozenset({other.uid})))
    assert trusted.load() == "hit" and kernel_folders(node) == {"a" * 52}


# ---------------------------------------------------------------------------------------------
# Two users through real processes: Inductor's code generation, and the ``ditrun`` command


def _as(user: User, command: list[str]) -> list[str]:
    return [
        "setpriv",
        f"--reuid={user.uid}",
        f"--regid={user.gid}",
        "--init-groups",
        "--inh-caps=+dac_read_search",
        "--ambient-caps=+dac_read_search",
        *command,
    ]


def _start(command: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    environment = quiet_env(**env)
    for name in (INDUCTOR_CACHE_ENV, TRITON_CACHE_ENV):
        if name not in env:
            environment.pop(name, None)
    return subprocess.Popen(
        command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return _finish(_start(command, cwd, **env))


def _job(folder: Path, cwd: Path, *args: str, user: Optional[User] = None, **env: str) -> dict:
    command = [sys.executable, str(JOB), str(folder), *args]
    proc = _run(_as(user, command) if user else command, cwd, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "console": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def team(other) -> dict:
    """The second user's first job on a team's shared cache (a setgid folder of the team group), trusting the
    team: its entry, and its Inductor folder, with ``/tmp/torchinductor_<user>`` made first by someone else."""
    base = Path(tempfile.mkdtemp(prefix="ditrun-team-", dir="/tmp"))
    base.chmod(0o755)
    home, folder = base / "home", base / "team-cache"
    home.mkdir(mode=0o700)
    os.chown(home, other.uid, other.gid)
    folder.mkdir()
    os.chown(folder, 0, other.team_gid)
    folder.chmod(0o2770)
    planted = Path(tempfile.gettempdir()) / f"torchinductor_{other.name}"
    planted.mkdir(mode=0o777, exist_ok=True)
    planted.chmod(0o777)
    try:
        first = _job(folder, home, "--trust", f"group:{other.team}", user=other, HOME=str(home), XDG_CACHE_HOME="")
        yield {"home": home, "folder": folder, "planted": planted, "first": first, "gid": other.team_gid}
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(planted, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_team_entry_is_loaded_where_the_team_is_trusted_and_set_aside_elsewhere(team, other, tmp_path):
    first, home, planted = team["first"], team["home"], team["planted"]
    entry = Path(first["entry"])
    assert (first["status"], first["wrote"]) == ("miss", True)
    st = os.lstat(entry)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (other.uid, other.team_gid, 0o640)
    # Inductor compiled into the user's own cache, not into the folder someone made first under its fixed name.
    inductor = home / ".cache" / "ditrun" / "inductor"
    assert first["inductor"] == str(inductor) and _mode(inductor) == 0o700 and _files(inductor)
    assert _files(planted) == []
    assert (
        f"ditrun: warning: Inductor's precompiled C++ headers are off: it keeps them in {planted} (owner root, group "
        "root, mode 0777): it belongs to another user, whatever TORCHINDUCTOR_CACHE_DIR says" in first["console"]
    )

    # This user, trusting nobody: set aside with one warning naming owner and mode, nothing put into Inductor's cache.
    untrusted = _job(team["folder"], tmp_path, "--load-only", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-a"))
    assert untrusted["status"] == "discarded"
    assert (
        f"ditrun: warning: compile cache entry {entry} set aside: {entry} (owner {other.name}, group {other.team}, "
        "mode 0640): it belongs to a user this run does not trust" in untrusted["console"]
    )
    assert _files(tmp_path / "inductor-a") == []

    # Trusting the team, this user loads it into Inductor's cache.
    trusted = _job(
        team["folder"],
        tmp_path,
        "--load-only",
        "--trust",
        f"group:{other.team}",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-b"),
    )
    assert trusted["status"] == "hit" and _files(tmp_path / "inductor-b")

    # The writer's next run, on a fresh node: Inductor finds every graph in the entry (it compiled none). (Graphs
    # compiled with the precompiled headers off, as here, are keyed apart from those compiled with them on.)
    fresh = home / "fresh-node"
    again = _job(
        team["folder"],
        home,
        "--trust",
        f"group:{other.team}",
        user=other,
        HOME=str(home),
        XDG_CACHE_HOME="",
        TORCHINDUCTOR_CACHE_DIR=str(fresh),
    )
    assert (again["status"], again["output"]) == ("hit", first["output"])
    assert again["fxgraph_cache_hit"] >= 1 and again["fxgraph_cache_miss"] == 0


def _cli(tmp_path: Path, name: str, cache, *overrides: str, user: Optional[User] = None, **env: str):
    """``ditrun`` started (``aot_eager``), its results in ``tmp_path/name``; ``_cli_result`` waits for it."""
    command = ditrun_command(
        "model.compile=on",
        "model.compile_backend=aot_eager",
        f"model.compile_cache={cache}",
        "metrics.report=false",
        "metrics.ssim=false",
        f"output_dir={tmp_path / name}",
        *overrides,
    )
    env.setdefault(INDUCTOR_CACHE_ENV, str(tmp_path / f"inductor-{name}"))
    return _start(_as(user, command) if user else command, tmp_path, **env), tmp_path / name / "summary.json"


def _cli_result(started) -> tuple[subprocess.CompletedProcess, Optional[dict]]:
    proc, summary = _finish(started[0]), started[1]
    return proc, json.loads(summary.read_text()) if summary.exists() else None


def _plant(team: dict, path: Path, key: str, owner: tuple[int, int], mode: int) -> None:
    """The team's entry (Inductor's real artifacts) as the entry of ``key`` at ``path``, with this owner and mode."""
    first = team["first"]
    write_entry(path, key, {}, read_entry(Path(first["entry"]), first["key"], Trust(group=team["gid"])))
    os.chown(path, *owner)
    path.chmod(mode)


@pytest.mark.slow
@pytest.mark.timeout(4 * JOB_TIMEOUT_S)
def test_the_command_sets_aside_what_another_user_could_have_written(team, other, tmp_path):
    """Through ``ditrun`` (``aot_eager``: Inductor's CPU code generation of the tiny model takes minutes): an entry
    of another user, one anyone may write and one in a folder anyone may write are set aside, said once and
    recorded as ``discarded``, and nothing of them reaches Inductor's cache; the team's entry, trusted, is loaded.
    The runs after the first (which names the key) run at once, each on a cache folder of its own."""
    proc, summary = _cli_result(_cli(tmp_path, "first", tmp_path / "first-cache"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["compile_cache"]["status"] == "miss"
    name = Path(summary["compile_cache"]["entries"][0]["entry"]).name
    key = name.removesuffix(ENTRY_SUFFIX)

    cases = {  # owner, mode, folder's mode, what the warning says, the run's overrides, what the run does
        "owner": ((other.uid, other.gid), 0o644, 0o755, f"(owner {other.name}, group {other.name}, mode 0644)"),
        "mode": ((0, 0), 0o666, 0o755, "(owner root, group root, mode 0666)"),
        "folder": ((0, 0), 0o600, 0o777, f"{tmp_path / 'folder-cache'} (owner root, group root, mode 0777)"),
        "team": ((other.uid, other.team_gid), 0o640, 0o755, None),
    }
    started = {}
    for case, (owner, mode, folder_mode, _) in cases.items():
        cache = tmp_path / f"{case}-cache"
        _plant(team, cache / name, key, owner, mode)
        cache.chmod(folder_mode)
        trust = [f"{TRUST_KEY}=[group:{other.team}]"] if case == "team" else []
        started[case] = _cli(tmp_path, case, cache, *trust)
    # The second user's run, told to compile where someone else made the folder first: one sentence, no run.
    planted = team["planted"]
    refused = _cli(
        team["home"], "refused", "off", user=other, HOME=str(team["home"]), TORCHINDUCTOR_CACHE_DIR=str(planted)
    )

    for case, (_, _, _, said) in cases.items():
        proc, summary = _cli_result(started[case])
        assert proc.returncode == 0, proc.stderr[-3000:]
        entry = tmp_path / f"{case}-cache" / name
        warnings = [line for line in proc.stdout.splitlines() if "compile cache entry" in line]
        if said is None:  # the team's entry, trusted
            assert warnings == [] and f"ditrun: compile cache: loaded {entry}" in proc.stdout
            assert [r["compile_cache"] for r in summary["startup_by_rank"]] == ["hit"]
            assert _files(tmp_path / f"inductor-{case}")  # the entry's graphs, in Inductor's cache
            assert summary["config"]["model"]["compile_cache_trust"] == [f"group:{other.team}"]  # recorded in the run
            continue
        assert len(warnings) == 1 and f"{entry} set aside: " in warnings[0] and said in warnings[0], warnings
        assert [r["compile_cache"] for r in summary["startup_by_rank"]] == ["discarded"], case
        assert _files(tmp_path / f"inductor-{case}") == [], case  # nothing of the entry was unpacked

    proc, _ = _cli_result(refused)
    assert proc.returncode != 0 and f"{INDUCTOR_CACHE_ENV}={planted} is a folder another user could" in proc.stderr
    assert "Traceback" not in proc.stderr and _files(planted) == []
