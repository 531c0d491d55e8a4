"""A picture of a run's edits: one row per edit with its reference, instruction, output and (where the
edit names one) correct result. ``ditrun report`` writes it as ``edits.png`` for a single run."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from ditrun.results import files

STRIP_CHART = "edits.png"
MAX_ROWS = 12
"""Edits drawn at most (the first ones): a picture of hundreds of rows is neither readable nor drawable."""


def _edit(record: dict, image: str, target: Optional[str] = None):
    from ditrun.workload.edit import Edit

    w, h = record["width"], record["height"]
    return Edit(
        index=0,
        id=record["edit"],
        image=image,
        prompt="",
        seed=0,
        width=w,
        height=h,
        ref_width=w,
        ref_height=h,
        target=target,
    )


def _pictures(record: dict, run_dir: Path, with_target: bool) -> tuple[list[np.ndarray], list[str], list[str]]:
    """The row's pictures, 8-bit RGB, their titles and the words under them (the output's scores against the
    correct edit, under the output); a picture that cannot be read is a white cell saying so."""
    from ditrun.results.files import to_rgb8
    from ditrun.workload.images import check_sources, load_image, target_image

    output = _output_picture(record, run_dir)
    blank = np.full_like(output, 255)
    source = record.get("reference")
    try:
        check_sources([_edit(record, source)])  # a regular file, a picture by its header, before it is decoded
        reference = to_rgb8(load_image(_edit(record, source)))
        reference_title = record["edit"]
    except Exception:  # noqa: BLE001 - moved or unreadable: the row still shows the output
        reference, reference_title = blank, f"{record['edit']} (reference not found)"
    pictures = [reference, output]
    titles = [reference_title, f'"{record["settings"]["edit"]["prompt"]}"']
    captions = ["", ""]
    if with_target:
        psnr, margin = record.get("psnr_target"), record.get("margin_db")
        if margin is not None:
            captions[1] = f"{psnr:.1f} dB to the correct edit, margin {margin:+.1f} dB"
        try:
            check_sources([_edit(record, source, record.get("target"))])
            target = target_image(_edit(record, source, record.get("target")))
        except Exception:  # noqa: BLE001
            target = None
        pictures.append(blank if target is None else target)
        titles.append("correct edit")
        captions.append("")
    return pictures, titles, captions


def _output_picture(record: dict, run_dir: Path) -> np.ndarray:
    """The edit's output as 8-bit RGB, read as the run's own file (``images/<edit>.png``, a regular file of a capped
    size, never through a link) and decoded within PIL's pixel limit."""
    from PIL import Image

    if record.get("image") != files.edit_outputs(str(record["edit"]))["image"]:
        raise ValueError(f"edit {record['edit']!r}: its record names no picture of the run")
    with Image.open(io.BytesIO(files.read_bytes(run_dir / record["image"]))) as picture:
        return np.asarray(picture.convert("RGB"))


def write_strip(run_dir: Path, records: list[dict], path: Path, plt) -> Optional[Path]:
    """``edits.png`` of a run's first ``MAX_ROWS`` ``records`` (``results.finished_edits``), drawn with ``plt``
    (matplotlib's pyplot, set up by the report); None when no record says which picture it edited. A failure
    to draw is a warning: the report of a finished run never fails on its picture."""
    records = [r for r in records if isinstance(r.get("reference"), str)][:MAX_ROWS]
    if not records:
        return None
    columns = 3 if any(r.get("target") for r in records) else 2
    try:
        fig, axes = plt.subplots(len(records), columns, figsize=(2.6 * columns, 2.6 * len(records)), squeeze=False)
        for row, record in zip(axes, records):
            for ax, picture, title, caption in zip(row, *_pictures(record, run_dir, columns == 3)):
                ax.imshow(picture)
                ax.set_title(title, fontsize=8)
                ax.text(0.5, -0.03, caption, transform=ax.transAxes, ha="center", va="top", fontsize=8)
                ax.axis("off")
        fig.tight_layout()
        files.save_figure(fig, path)
        plt.close(fig)
    except Exception as err:  # noqa: BLE001
        print(f"ditrun: warning: {path} was not drawn ({type(err).__name__}: {err})", file=sys.stderr, flush=True)
        plt.close("all")
        return None
    return path
