"""A picture of a run's edits: one row per edit with its reference, instruction, output and (where the
edit names one) correct result. ``ditrun report`` writes it as ``edits.png`` for a single run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

STRIP_CHART = "edits.png"


def _reference(settings: dict, width: int, height: int) -> np.ndarray:
    from ditrun.workload import Edit, load_image

    edit = Edit(index=0, id="strip", image=settings["image"], prompt="", seed=0, width=width, height=height,
                ref_width=width, ref_height=height)
    return load_image(edit)[0].permute(1, 2, 0).numpy()


def _target(record: dict, settings: dict) -> Optional[np.ndarray]:
    from ditrun.workload import Edit, target_image

    if not record.get("target"):
        return None
    edit = Edit(index=0, id=record["edit"], image=settings["image"], prompt="", seed=0, width=record["width"],
                height=record["height"], ref_width=record["width"], ref_height=record["height"],
                target=record["target"])
    return target_image(edit)


def write_strip(run_dir: Path, path: Path, plt) -> Optional[Path]:
    """``edits.png`` for the run in ``run_dir``, drawn with ``plt`` (matplotlib's pyplot, set up by the report);
    None when its records do not say what each edit was."""
    from skimage import io

    lines = (run_dir / "edits.jsonl").read_text().splitlines() if (run_dir / "edits.jsonl").is_file() else []
    records = [r for r in map(json.loads, filter(None, lines)) if r.get("settings", {}).get("edit")]
    if not records:
        return None
    columns = 3 if any(r.get("target") for r in records) else 2
    fig, axes = plt.subplots(len(records), columns, figsize=(2.6 * columns, 2.6 * len(records)), squeeze=False)
    for row, record in zip(axes, records):
        settings = record["settings"]["edit"]
        pictures = [_reference(settings, record["width"], record["height"]), io.imread(run_dir / record["image"])]
        titles = [f"{record['edit']}", f"\"{settings['prompt']}\""]
        target = _target(record, settings)
        if columns == 3:
            pictures.append(target if target is not None else np.ones_like(pictures[1]))
            ssim = record.get("ssim_target")
            titles.append("correct edit" + (f" (SSIM {ssim:.2f})" if ssim is not None else ""))
        for ax, picture, title in zip(row, pictures, titles):
            ax.imshow(picture)
            ax.set_title(title, fontsize=8)
            ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
