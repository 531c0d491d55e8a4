"""The results directory of a run: ``edits.jsonl`` (one line per finished edit), PNGs, ``summary.json``.

Each edit's line is appended with a single ``write`` on an ``O_APPEND`` descriptor and flushed
to disk, so a crash never leaves half a line and a rerun in the same directory skips every edit
already recorded.
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
    """Records already in ``edits.jsonl``, by edit id (a torn last line, if any, is ignored)."""
    path = out_dir / EDITS_FILE
    if not path.exists():
        return {}
    records = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        records[record["edit"]] = record
    return records


def append_record(out_dir: Path, record: dict) -> None:
    line = (json.dumps(record, sort_keys=False) + "\n").encode()
    fd = os.open(out_dir / EDITS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def to_rgb8(image: torch.Tensor) -> np.ndarray:
    """The pixels a PNG holds: [1, 3, H, W] in [0, 1] -> [H, W, 3] uint8."""
    return (image[0].permute(1, 2, 0).float().clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)


def save_png(image: torch.Tensor | np.ndarray, path: Path) -> None:
    """image: [1, 3, H, W] in [0, 1], or [H, W, 3] uint8."""
    from skimage import io

    array = image if isinstance(image, np.ndarray) else to_rgb8(image)
    tmp = path.with_suffix(".tmp.png")
    io.imsave(tmp, array, check_contrast=False)
    os.replace(tmp, path)


def median_after_warmup(values: Iterable[float], warmup: int) -> float:
    values = list(values)
    kept = values[warmup:] if len(values) > warmup else values
    return float(statistics.median(kept)) if kept else float("nan")


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
