"""The files of a run: ``edits.jsonl`` (one line per finished edit), PNGs, latents, ``summary.json``.

Each edit's line is appended with a single ``write`` on an ``O_APPEND`` descriptor and flushed
to disk; every other file is written under a temporary name and renamed into place, so a crash
leaves either the whole file or none. Who may write which file, and what a rerun does with
them, is ``rundir.py``'s protocol.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np

if TYPE_CHECKING:  # torch is not imported at run time: ``ditrun report`` reads these files without it
    import torch

EDITS_FILE = "edits.jsonl"
SUMMARY_FILE = "summary.json"


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
        os.write(fd, (("\n" if torn else "") + line.rstrip("\n") + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def append_record(path: Path, record: dict) -> None:
    append_line(path, json.dumps(record))


def output_path(out_dir: Path, name: str) -> Path:
    """``out_dir / name``, refusing any name that would land outside ``out_dir``."""
    path = out_dir / name
    if path.resolve().parent != out_dir.resolve():
        raise ValueError(f"output file {name!r} would be written outside {out_dir}")
    return path


def _temporary(path: Path) -> Path:
    """A name in the same directory that no other process uses (the rename is then atomic)."""
    return path.with_name(f"{path.stem}.{os.getpid()}.tmp{path.suffix}")


def save_latents(latents: torch.Tensor, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = _temporary(path)
    save_file({"latents": latents.cpu().contiguous()}, str(tmp))
    os.replace(tmp, path)


def to_rgb8(image: torch.Tensor) -> np.ndarray:
    """The pixels a PNG holds: [1, 3, H, W] in [0, 1] -> [H, W, 3] uint8."""
    return (image[0].permute(1, 2, 0).float().clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)


def save_png(image: torch.Tensor | np.ndarray, path: Path) -> None:
    """image: [1, 3, H, W] in [0, 1], or [H, W, 3] uint8."""
    from skimage import io

    array = image if isinstance(image, np.ndarray) else to_rgb8(image)
    tmp = _temporary(path)
    io.imsave(tmp, array, check_contrast=False)
    os.replace(tmp, path)


def median_after_warmup(values: Iterable[float], warmup: int) -> float:
    values = list(values)
    kept = values[warmup:] if len(values) > warmup else values
    return float(statistics.median(kept)) if kept else float("nan")


def write_json(path: Path, data: dict) -> None:
    tmp = _temporary(path)
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path``, on disk before the name points at it (temporary file, fsync, rename)."""
    tmp = _temporary(path)
    with open(tmp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
