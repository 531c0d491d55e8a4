"""Image quality: SSIM of each edit's image against its BF16 reference, and the quality gate.

Images are compared as their PNGs hold them (8-bit RGB, scaled to [0, 1]) with scikit-image's
``structural_similarity`` over the colour channels, data range 1. ``ssim`` compares the run's
image with the first BF16 reference run, ``ssim_rerun`` a second BF16 run with the first: on
GPUs two BF16 runs differ (reduction order, atomics), so ``ssim_pct_of_rerun`` = 100 x ssim /
ssim_rerun says how much of the attainable similarity a precision keeps.
"""

from __future__ import annotations

import statistics
from typing import Optional

import numpy as np

QUALITY_FIELDS = ("ssim", "ssim_rerun", "ssim_pct_of_rerun")


class QualityGateError(RuntimeError):
    """A verdict on the run's quality, in one sentence: its SSIM is below ``metrics.min_ssim_pct`` (the message
    says by how much), or an edit's reference is broken (``reference.BrokenReference``). Exit status 1."""


def _unit(rgb8: np.ndarray) -> np.ndarray:
    if rgb8.dtype != np.uint8 or rgb8.ndim != 3 or rgb8.shape[-1] != 3:
        raise TypeError(f"expected an [H, W, 3] uint8 image, got {rgb8.dtype} {rgb8.shape}")
    return rgb8.astype(np.float64) / 255.0


def ssim(image: np.ndarray, reference: np.ndarray) -> float:
    """SSIM of two [H, W, 3] uint8 images (1.0 when identical)."""
    from skimage.metrics import structural_similarity

    return float(structural_similarity(_unit(image), _unit(reference), channel_axis=-1, data_range=1.0))


def ssim_map(image: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Local SSIM, averaged over the colour channels: [H, W] float in [-1, 1] (1 = identical there)."""
    from skimage.metrics import structural_similarity

    _, full = structural_similarity(_unit(image), _unit(reference), channel_axis=-1, data_range=1.0, full=True)
    return full.mean(axis=-1)


def quality_fields(image: np.ndarray, reference) -> dict:
    """The SSIM fields of one edit's record; all None when SSIM is off (``reference`` is None)."""
    if reference is None:
        return dict.fromkeys(QUALITY_FIELDS)
    value = ssim(image, reference.image)
    rerun = ssim(reference.rerun, reference.image)
    return {"ssim": value, "ssim_rerun": rerun, "ssim_pct_of_rerun": 100.0 * value / rerun if rerun > 0 else None}


def quality_summary(records: list[dict]) -> dict:
    """Medians over every edit (warm-up changes timings, not images)."""
    summary = {}
    for key in QUALITY_FIELDS:
        values = [r[key] for r in records if r.get(key) is not None]
        summary[f"{key}_median"] = float(statistics.median(values)) if values else None
    return summary


def gate_failure(summary: dict, min_pct: Optional[float]) -> Optional[str]:
    """Why the run fails ``metrics.min_ssim_pct``, or None when it passes (or no gate is set)."""
    if min_pct is None:
        return None
    pct = summary.get("ssim_pct_of_rerun_median")
    if pct is None:
        return f"metrics.min_ssim_pct={min_pct:g} is set but no edit has an SSIM (metrics.ssim=false?)."
    if pct >= min_pct:
        return None
    return (f"SSIM gate failed: median SSIM {summary['ssim_median']:.4f} is {pct:.2f}% of the BF16 rerun SSIM "
            f"{summary['ssim_rerun_median']:.4f}, below metrics.min_ssim_pct={min_pct:g}.")
