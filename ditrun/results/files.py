"""The files of a run: ``edits.jsonl`` (one line per finished edit), ``summary.json``, and each
edit's ``images/<edit>.png`` and ``latents/<edit>.latents.safetensors``.

Each edit's outputs live in a folder of their kind, where nothing else is written, so no edit id
can name one of the run's own files (``summary.json``, the report's charts, the lock). Each
edit's line is appended on an ``O_APPEND`` descriptor and flushed to disk; every other file is
written under a temporary name (``TEMPORARY_PREFIX``, which no edit id can start with), flushed,
renamed into place and its directory flushed, so a crash or a power loss leaves either the whole
file or none, and an edit's record, written last, never points at a file that is not on disk.
Who may write which file, and what a rerun does with them, is ``rundir.py``'s protocol.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is not imported at run time: ``ditrun report`` reads these files without it
    import torch

EDITS_FILE = "edits.jsonl"
SUMMARY_FILE = "summary.json"
RUN_FILE = "run.json"  # the settings the directory belongs to (``rundir.record_run``)
IMAGES_DIR = "images"
LATENTS_DIR = "latents"
# Temporary files start with a dot, which an edit id cannot (workload.SAFE_ID): recovery removes
# exactly the files with this prefix, and they are never another file's name.
TEMPORARY_PREFIX = ".ditrun-tmp."


def edit_outputs(edit_id: str) -> dict[str, str]:
    """The record's output fields -> the edit's files, relative to the run directory."""
    return {"image": f"{IMAGES_DIR}/{edit_id}.png", "latents": f"{LATENTS_DIR}/{edit_id}.latents.safetensors"}


def finished_edits(out_dir: Path) -> dict[str, dict]:
    """Records in ``edits.jsonl``, by edit id, first one kept (lines that are not records are skipped)."""
    path = out_dir / EDITS_FILE
    if not path.exists():
        return {}
    records = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "edit" in record:
            records.setdefault(record["edit"], record)
    return records


def append_line(path: Path, line: str) -> None:
    """One whole line at the end of ``path``, on disk when this returns.

    A file whose last line was torn (a crash mid-write) gets a newline first, so the fragment
    stays a line of its own instead of swallowing this one.
    """
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        write_all(fd, (("\n" if torn else "") + line.rstrip("\n") + "\n").encode(), path)
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
    """``out_dir / name`` for a name of ``edit_outputs``, refusing any that would land outside its folder."""
    path, folder = out_dir / name, Path(name).parent
    if str(folder) not in (IMAGES_DIR, LATENTS_DIR) or path.resolve().parent != (out_dir / folder).resolve():
        raise ValueError(f"output file {name!r} would be written outside {out_dir / folder}")
    return path


def _temporary(path: Path) -> Path:
    """A name in the same directory that no other process uses (the rename is then atomic), on any node of a
    shared file system (process ids repeat across nodes)."""
    return path.with_name(f"{TEMPORARY_PREFIX}{socket.gethostname()}.{os.getpid()}.{path.name}")


def write_file(path: Path, data: bytes) -> str:
    """``data`` as the whole of ``path``, on disk with its directory entry when this returns; its sha256."""
    _make_folder(path.parent)
    tmp = _temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def save_latents(latents: torch.Tensor, path: Path) -> str:
    """latents: [1, tokens, 64]; returns the file's sha256."""
    from safetensors.torch import save

    return write_file(path, save({"latents": latents.cpu().contiguous()}))


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


def write_json(path: Path, data: dict) -> None:
    write_file(path, json.dumps(data, indent=2, default=str).encode())
