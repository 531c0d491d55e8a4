"""The files of a run: ``edits.jsonl`` (one line per finished edit), ``summary.json``, and each
edit's ``images/<edit>.png`` and ``latents/<edit>.latents.safetensors``.

Each edit's outputs live in a folder of their kind, where nothing else is written, so no edit id
can name one of the run's own files (``summary.json``, the report's charts, the lock). Each
edit's line is appended on an ``O_APPEND`` descriptor and flushed to disk; every other file is
written under a temporary name (``TEMPORARY_PREFIX``, which no edit id can start with), flushed,
renamed into place and its directory flushed, so a crash or a power loss leaves either the whole
file or none, and an edit's record, written last, never points at a file that is not on disk.
Who may write which file, and what a rerun does with them, is ``rundir.py``'s protocol.

Nothing another user planted is followed: every file of a run is opened ``O_NOFOLLOW``
(``open_nofollow``: a symbolic link is refused, one sentence), temporaries are also ``O_EXCL``
under an unpredictable name, and a folder written into is made, or checked, as a real directory
of this user (``owned_folder``).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pwd
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from ditrun.errors import UserError

if TYPE_CHECKING:  # torch is not imported at run time: ``ditrun report`` reads these files without it
    import torch

EDITS_FILE = "edits.jsonl"
SUMMARY_FILE = "summary.json"
RUN_FILE = "run.json"  # the settings the directory belongs to (``rundir.record_run``)
IMAGES_DIR = "images"
LATENTS_DIR = "latents"
WANDB_DIR = "wandb"  # the offline W&B run's folder (``metrics.wandb``)
# Temporary files start with a dot, which an edit id cannot (workload.SAFE_ID): recovery removes
# exactly the files with this prefix, and they are never another file's name.
TEMPORARY_PREFIX = ".ditrun-tmp."


# What a node does to a run's writes, as opposed to a bug: full, over a quota or a file size limit, unwritable,
# read-only (``run/folders.py``).
NODE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)


def is_node_fault(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in NODE_ERRNOS


def edit_outputs(edit_id: str) -> dict[str, str]:
    """The record's output fields -> the edit's files, relative to the run directory."""
    return {"image": f"{IMAGES_DIR}/{edit_id}.png", "latents": f"{LATENTS_DIR}/{edit_id}.latents.safetensors"}


def finished_edits(out_dir: Path) -> dict[str, dict]:
    """Records in ``edits.jsonl``, by edit id, first one kept (lines that are not records are skipped)."""
    records = {}
    for line in read_text(out_dir / EDITS_FILE).splitlines():
        record = parse_json(line)
        if isinstance(record, dict) and isinstance(record.get("edit"), str):
            records.setdefault(record["edit"], record)
    return records


READ_CAP = 64 << 20
"""Bytes of a run's file read at most: ``run.json`` and ``summary.json`` hold kilobytes, ``edits.jsonl`` a few per
edit. A larger file is refused unread, so what a tree holds never sets how much memory its reader takes."""
MAX_DEPTH = 32
"""Nesting of a run's JSON at most (ditrun writes 6 levels); deeper is refused, so no reader of it recurses far."""


def parse_json(text: str | bytes):
    """The JSON value of ``text``, or None when it is not JSON ditrun could have written: malformed, not UTF-8,
    nested deeper than ``MAX_DEPTH`` (which would otherwise end in a ``RecursionError`` here or in a reader)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return value if _depth_within(value, MAX_DEPTH) else None


def _depth_within(value, limit: int) -> bool:
    """Whether ``value``'s lists and objects nest at most ``limit`` deep (iterative: a deep one cannot recurse)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        if children and depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return True


def append_line(path: Path, line: str) -> None:
    """One whole line at the end of ``path``, on disk when this returns.

    A file whose last line was torn (a crash mid-write) gets a newline first, so the fragment
    stays a line of its own instead of swallowing this one.
    """
    fd = open_nofollow(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        try:
            write_all(fd, (("\n" if torn else "") + line.rstrip("\n") + "\n").encode(), path)
        except OSError:
            os.ftruncate(fd, size)  # a full disk: no part of the line stays, and its space is given back
            raise
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes, path: Path) -> None:
    """All of ``data`` to ``fd`` (``os.write`` may write less than it was given: a full disk, a file size limit)."""
    view, written = memoryview(data), 0
    while written < len(data):
        try:
            n = os.write(fd, view[written:])
        except OSError as err:
            raise OSError(err.errno, f"{err.strerror}: wrote {written} of {len(data)} bytes to {path}") from err
        if n == 0:
            raise OSError(errno.ENOSPC, f"no space: wrote {written} of {len(data)} bytes to {path}")
        written += n


def append_record(path: Path, record: dict) -> None:
    append_line(path, json.dumps(record))


def output_path(out_dir: Path, name: str) -> Path:
    """``out_dir / name`` for a name of ``edit_outputs``, refusing any that would land outside its folder (made,
    or checked, as a real folder of this user: ``owned_folder``)."""
    path, folder = out_dir / name, Path(name).parent
    if str(folder) not in (IMAGES_DIR, LATENTS_DIR) or path.name in ("", ".", ".."):
        raise ValueError(f"output file {name!r} would be written outside {out_dir / folder}")
    owned_folder(out_dir / folder)
    return path


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a run's file that never follows a symbolic link planted at ``path``: one is refused."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise refusal(path, os.lstat(path)) from None
        raise


def read_text(path: Path, cap: int = READ_CAP) -> str:
    """The text of a run's file ("" when there is none): ``read_bytes``."""
    return read_bytes(path, cap).decode(errors="replace")


def read_bytes(path: Path, cap: int = READ_CAP) -> bytes:
    """The bytes of a run's regular file (b"" when there is none), never through a symbolic link and never waiting
    (a FIFO is not opened for reading until it is known to be a file); anything other than a regular file, or a
    file larger than ``cap`` bytes, is refused (``Refused``) unread."""
    status = check_regular(path)
    if status is None:
        return b""
    try:
        fd = open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return b""
    with os.fdopen(fd, "rb") as file:
        check_regular(path, os.fstat(fd), cap)  # what was opened, if it changed since the lstat
        data = file.read(cap + 1)
    if len(data) > cap:
        raise _too_large(path, len(data), cap)
    return data


def check_regular(path: Path, status: Optional[os.stat_result] = None, cap: int = READ_CAP) -> Optional[os.stat_result]:
    """``path``'s status (``lstat`` unless given; None when absent), refusing anything but a regular file of at
    most ``cap`` bytes: a symbolic link, FIFO, device, socket or folder where a run's file belongs."""
    try:
        status = status or os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(status.st_mode):
        raise refusal(path, status)
    if status.st_size > cap:
        raise _too_large(path, status.st_size, cap)
    return status


def _too_large(path: Path, size: int, cap: int) -> "Refused":
    return Refused(
        f"{path} holds {size} bytes, more than the {cap >> 20} MiB a run's file may (ditrun reads no larger one); "
        "remove it or choose another results directory (hydra.run.dir=... or output_dir=...).",
        f"{path.name} is larger than {cap >> 20} MiB",
    )


def owned_folder(folder: Path) -> None:
    """``folder`` made if absent (its parent must exist), else checked: a real directory owned by this user."""
    try:
        os.mkdir(folder)
        fsync_folder(folder.parent)  # the new folder's own entry
    except FileExistsError:
        pass
    status = check_owned(folder)
    if status is not None and not stat.S_ISDIR(status.st_mode):
        raise refusal(folder, status, "a file, not a folder,")


def check_owned(path: Path) -> Optional[os.stat_result]:
    """``path``'s own ``lstat`` (None when absent), refusing a symbolic link or an entry of another user."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(status.st_mode) or status.st_uid != os.geteuid():
        raise refusal(path, status)
    return status


class Refused(UserError):
    """A run's file or folder ditrun will not use; ``short`` says why in a few words (``ditrun report``'s line)."""

    def __init__(self, sentence: str, short: str):
        super().__init__(sentence)
        self.short = short


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISREG, "a file"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def kind_of(mode: int) -> str:
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "not a file")


def refusal(path: Path, status: os.stat_result, kind: str = "") -> Refused:
    """The one sentence refusing ``path``: what it is, its owner, and what a run writes into."""
    kind = kind or kind_of(status.st_mode)
    return Refused(
        f"{path} is {kind} owned by {_user(status.st_uid)}, and ditrun writes a run only into real files and "
        f"folders owned by {_user(os.geteuid())} (no symbolic links, nothing of another user's); remove it or "
        "choose another results directory (hydra.run.dir=... or output_dir=...).",
        f"{path.name} is {kind} owned by {_user(status.st_uid)}",
    )


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new file beside ``path`` (the rename is then atomic) under a name no other process can guess, so nothing
    can be planted there first; ``O_EXCL`` refuses anything that is there all the same."""
    tmp = path.with_name(f"{TEMPORARY_PREFIX}{secrets.token_hex(8)}.{path.name}")
    return open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), tmp


def write_file(path: Path, data: bytes) -> str:
    """``data`` as the whole of ``path``, on disk with its directory entry when this returns; its sha256.

    The rename replaces whatever entry ``path`` is, a symbolic link included, and never writes through it."""
    _make_folder(path.parent)
    fd, tmp = _create_temporary(path)
    try:
        write_all(fd, data, path)
        os.fsync(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: give its space back now (a crash leaves it to recovery)
        raise
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_folder(path.parent)
    return hashlib.sha256(data).hexdigest()


def _make_folder(folder: Path) -> None:
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        fsync_folder(folder.parent)  # the new folder's own entry


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename or a new file is durable only once its directory is)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that cannot flush a directory say so
            raise
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def save_latents(latents: torch.Tensor, path: Path) -> str:
    """latents: [1, tokens, 64]; returns the file's sha256."""
    from safetensors.torch import save

    return write_file(path, save({"latents": latents.cpu().contiguous()}))


def save_outputs(out_dir: Path, edit_id: str, image: torch.Tensor, latents: torch.Tensor) -> dict[str, str]:
    """The edit's image and latents (``edit_outputs``); their sha256 by field. Where one cannot be written (a full
    disk), neither stays: ``remove_outputs``."""
    outputs = edit_outputs(edit_id)
    try:
        return {
            "image": save_png(image, output_path(out_dir, outputs["image"])),
            "latents": save_latents(latents, output_path(out_dir, outputs["latents"])),
        }
    except OSError:
        remove_outputs(out_dir, edit_id)
        raise


def remove_outputs(out_dir: Path, edit_id: str) -> None:
    """The files of an edit left without a record (one of its files or its record could not be written): no record
    points at them, as a run writes an edit only while none holds it, and their space is given back."""
    for name in edit_outputs(edit_id).values():
        try:
            (out_dir / name).unlink()
        except OSError:
            pass  # not written, or gone


def to_rgb8(image: torch.Tensor) -> np.ndarray:
    """The pixels a PNG holds: [1, 3, H, W] in [0, 1] -> [H, W, 3] uint8."""
    return (image[0].permute(1, 2, 0).float().clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)


def save_png(image: torch.Tensor | np.ndarray, path: Path) -> str:
    """image: [1, 3, H, W] in [0, 1], or [H, W, 3] uint8; returns the file's sha256."""
    from PIL import Image

    array = image if isinstance(image, np.ndarray) else to_rgb8(image)
    encoded = io.BytesIO()
    Image.fromarray(array).save(encoded, format="PNG")
    return write_file(path, encoded.getvalue())


def save_figure(fig, path: Path) -> str:
    """A matplotlib figure as a PNG at ``path`` (through ``write_file``: ``savefig`` on a path would write through
    a symbolic link planted there); returns the file's sha256."""
    encoded = io.BytesIO()
    fig.savefig(encoded, format="png", dpi=100)
    return write_file(path, encoded.getvalue())


class RunLogFile(logging.FileHandler):
    """Hydra's job log (``<run dir>/<job>.log``: ``conf/hydra/job_logging/ditrun.yaml``), opened as a run's other
    files are: in a real folder of this user, never through a symbolic link. The file is made at its first record,
    so a run that logs nothing leaves none; what is at its path is checked at once, before the run starts."""

    def __init__(self, filename, mode: str = "a", encoding=None, delay: bool = True, errors=None):
        super().__init__(filename, mode, encoding, delay=True, errors=errors)
        path = Path(self.baseFilename)
        owned_folder(path.parent)
        check_owned(path)

    def _open(self):
        path = Path(self.baseFilename)
        owned_folder(path.parent)
        fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


def write_json(path: Path, data: dict) -> None:
    write_file(path, json.dumps(data, indent=2, default=str).encode())
