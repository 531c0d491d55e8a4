"""Whom ditrun trusts with what it loads as code: a file that no user but the reader, root and those the config
names could have written.

A node is shared by many users, and a cache that holds code (the compile cache's entries: Inductor's generated
code and Triton's kernels; Inductor's and Triton's own folders) runs as whoever loads it: anyone who could have
written such a file, or put another in its place through a folder above it, could run code as that user. So a
file is loaded only when

* it is opened without following a symbolic link (``O_NOFOLLOW``), and its descriptor (``os.fstat``: what is
  checked is what is read, with no race between the two) is a regular file owned by the reader, root or a
  trusted user, and writable by nobody else: not by others, and by its group only when that is the trusted group;
* every folder from the file's up to the cache root (each as it resolves, ``lstat``) is held the same way, except
  that one writable by others (or by an untrusted group) is allowed when its sticky bit is set: there only a
  file's owner may rename or remove it.

``Trust`` widens "the reader and root" to the users and the group that one config key names
(``model.compile_cache_trust``): a member of the trusted group is a trusted user, and a file or folder writable by
that group is allowed. ``Untrusted``'s message names the file, its owner and its mode, for the one warning or
sentence that refuses it.
"""

from __future__ import annotations

import errno
import functools
import grp
import os
import pwd
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ditrun.errors import UserError

GROUP_PREFIX = "group:"
"""How the trust key names a group (``group:<name>``); every other entry is a user."""


class Untrusted(Exception):
    """A file or folder another user could have written; the message names it, its owner and its mode."""


@functools.lru_cache(maxsize=None)
def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


@functools.lru_cache(maxsize=None)
def _in_group(uid: int, gid: int) -> bool:
    """Whether user ``uid`` belongs to group ``gid`` (as its primary group or a listed member)."""
    try:
        user = pwd.getpwuid(uid)
        return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def describe(path: Path, st: os.stat_result) -> str:
    """``path (owner <name>, group <name>, mode 0644)``: who could have written it."""
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = f"gid {st.st_gid}"
    return f"{path} (owner {user_name(st.st_uid)}, group {group}, mode {stat.S_IMODE(st.st_mode):04o})"


@dataclass(frozen=True)
class Trust:
    """Who besides the reader and root may have written what is loaded (see the module doc)."""

    users: frozenset = frozenset()
    """Trusted users' ids."""
    group: Optional[int] = None
    """The trusted group's id: its members are trusted users, and what it may write is allowed."""

    @classmethod
    def parse(cls, names: Optional[Sequence[str]], key: str) -> Trust:
        """The users and the ``group:<name>`` that ``key`` lists (names or numeric ids); one sentence naming the
        key when a name is unknown here or more than one group is named."""
        users, groups = set(), []
        for name in [str(n) for n in (names or [])]:
            if name.startswith(GROUP_PREFIX):
                groups.append(_lookup(name[len(GROUP_PREFIX) :], grp.getgrnam, "gr_gid", key, "group"))
            else:
                users.add(_lookup(name, pwd.getpwnam, "pw_uid", key, "user"))
        if len(groups) > 1:
            raise UserError(f"{key} names {len(groups)} groups; name one group (group:<name>) and any users.")
        return cls(frozenset(users), groups[0] if groups else None)

    def trusts_owner(self, uid: int) -> bool:
        return uid in (os.geteuid(), 0) or uid in self.users or (self.group is not None and _in_group(uid, self.group))

    def why_not(self, st: os.stat_result, folder: bool) -> Optional[str]:
        """Why another user could have written what ``st`` describes; None when only trusted users could."""
        mode = st.st_mode
        if not self.trusts_owner(st.st_uid):
            return "it belongs to a user this run does not trust"
        if folder and mode & stat.S_ISVTX:  # sticky: only a file's owner renames or removes it
            return None
        if mode & stat.S_IWOTH:
            return "anyone may write it"
        if mode & stat.S_IWGRP and st.st_gid != self.group:
            return "its group, which this run does not trust, may write it"
        return None

    @property
    def file_mode(self) -> int:
        """The mode a writer gives what it writes for these readers: 0600 (the reader alone); 0640 with the
        trusted group as the file's group; 0644 when only users are trusted (they read it as others)."""
        return 0o640 if self.group is not None else 0o644 if self.users else 0o600

    @property
    def folder_mode(self) -> int:
        """The mode of a folder a writer makes: 0700; 2770 for a trusted group (its members write entries too, and
        the setgid bit gives them the group); 0755 when only users are trusted."""
        return 0o2770 if self.group is not None else 0o755 if self.users else 0o700


def _lookup(name: str, get, field: str, key: str, kind: str) -> int:
    try:
        return getattr(get(name), field)
    except KeyError:
        if name.isdigit():
            return int(name)
        raise UserError(f"{key} names {kind} {name!r}, which this machine does not know; name {kind}s by name or id.")


def _check(path: Path, st: os.stat_result, trust: Trust, folder: bool) -> None:
    why = trust.why_not(st, folder)
    if why is not None:
        raise Untrusted(f"{describe(path, st)}: {why}")


def check_folders(folder: Path, root: Path, trust: Trust) -> None:
    """``folder`` and every folder above it up to ``root`` (both as they resolve), each a real folder that only
    trusted users could have written (see the module doc); ``Untrusted`` names the first that is not."""
    folder, root = Path(os.path.realpath(folder)), Path(os.path.realpath(root))
    if folder != root and root not in folder.parents:
        raise Untrusted(f"{folder} is not inside {root}")
    for current in [folder, *folder.parents]:
        st = os.lstat(current)
        if not stat.S_ISDIR(st.st_mode):
            raise Untrusted(f"{describe(current, st)} is not a folder")
        _check(current, st, trust, folder=True)
        if current == root:
            return


def open_trusted(path: Path, root: Path, trust: Trust) -> int:
    """A descriptor for reading ``path``, a file under ``root`` that only trusted users could have written: opened
    without following a link, checked on the descriptor, its folders up to ``root`` checked (``check_folders``).
    ``FileNotFoundError`` when there is none; ``Untrusted`` naming the file (or folder), its owner and its mode."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO does not block
    except OSError as err:
        if err.errno == errno.ELOOP and os.path.islink(path):
            raise Untrusted(f"{describe(path, os.lstat(path))} is a symbolic link") from err
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{describe(path, st)} is not a regular file")
        _check(path, st, trust, folder=False)
        check_folders(path.parent, root, trust)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_trusted(path: Path, root: Path, trust: Trust) -> bytes:
    """The whole of ``path`` when only trusted users could have written it (``open_trusted``)."""
    fd = open_trusted(path, root, trust)
    with os.fdopen(fd, "rb") as file:
        return file.read()


def write_for(path: Path, data: bytes, trust: Trust) -> None:
    """``data`` as the whole of ``path``, for ``trust``'s readers (``Trust.file_mode``, the trusted group's) and
    writable by this user alone: a temporary of an unpredictable name in the same folder, made there
    (``O_EXCL|O_NOFOLLOW``: never a file or link another user planted), flushed and renamed over ``path``. Missing
    folders are made with ``Trust.folder_mode``."""
    _make_folders(path.parent, trust)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as file:
            if trust.group is not None:
                os.fchown(fd, -1, trust.group)
            os.fchmod(fd, trust.file_mode)  # exactly: the umask would take the group's read bit away
            file.write(data)
            file.flush()
            os.fsync(fd)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _make_folders(folder: Path, trust: Trust) -> None:
    """``folder`` and the folders above it that are missing, each with ``Trust.folder_mode`` (and group)."""
    missing = [p for p in [folder, *folder.parents] if not os.path.lexists(p)]
    for made in reversed(missing):
        try:
            os.mkdir(made, 0o700)
        except FileExistsError:
            continue
        if trust.group is not None:
            os.chown(made, -1, trust.group)
        os.chmod(made, trust.folder_mode)


def private_folder(path: Path) -> Path:
    """``path``, a folder only this user (and root) could have written: made 0700 where missing, then checked to be
    a real folder owned by this user that nobody else may write, below folders only this user and root could
    have written (sticky ones allowed). ``Untrusted`` names the first that is not."""
    path = Path(os.path.abspath(path))
    _make_folders(path, Trust())  # one another process made meanwhile is checked below like any other
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{describe(path, st)} is not a folder (a link or a file)")
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{describe(path, st)}: it belongs to another user")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise Untrusted(f"{describe(path, st)}: others may write it")
    check_folders(path, Path(path.anchor), Trust())
    return path
