"""Image quality: SSIM of each edit's image against its BF16 reference, and the quality gate.

Images are compared as their PNGs hold them (8-bit RGB, scaled to [0, 1]) with scikit-image's
``structural_similarity`` over the colour channels, data range 1. ``ssim`` compares the run's
image with the first BF16 reference run, ``ssim_rerun`` a second BF16 run with the first: on
GPUs two BF16 runs differ (reduction order, atomics), so ``ssim_pct_of_rerun`` = 100 x ssim /
ssim_rerun says how much of the attainable similarity a precision keeps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ditrun.registry import Registry

QUALITY_FIELDS = ("ssim", "ssim_rerun", "ssim_pct_of_rerun", "ssim_target", "ssim_target_bf16")
DEFAULT_TARGET_PCT = 98.0
"""The quality target when ``metrics.min_ssim_pct`` is unset: within 2% of the BF16 run's own score."""


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


def quality_fields(image: np.ndarray, reference, target: Optional[np.ndarray] = None) -> dict:
    """The SSIM fields of one edit's record; those against the BF16 reference are None when SSIM is off
    (``reference`` is None), those against the correct result None when the edit names none (``target``)."""
    fields = dict.fromkeys(QUALITY_FIELDS)
    if target is not None:
        fields["ssim_target"] = ssim(image, target)
        fields["ssim_target_bf16"] = None if reference is None else ssim(reference.image, target)
    if reference is None:
        return fields
    value = ssim(image, reference.image)
    rerun = ssim(reference.rerun, reference.image)
    fields.update(ssim=value, ssim_rerun=rerun, ssim_pct_of_rerun=100.0 * value / rerun if rerun > 0 else None)
    return fields


def quality_summary(records: list[dict]) -> dict:
    """Medians over every edit (warm-up changes timings, not images)."""
    summary = {}
    for key in QUALITY_FIELDS:
        values = [r[key] for r in records if r.get(key) is not None]
        summary[f"{key}_median"] = float(statistics.median(values)) if values else None
    return summary


@dataclass(frozen=True)
class QualityMeasure:
    """One ``metrics.quality``: which SSIM judges a run, as a percentage of the BF16 run's own score on it."""

    name: str
    doc: str
    pct: Callable[[dict, Optional[float]], Optional[float]]
    """(the run's summary, the BF16 run's own score where the summary lacks it) -> percentage, or None."""
    missing: Callable[[dict], str]
    """(the run's summary) -> why it has no percentage, said when one is asked for."""

    def describe(self, summary: dict, pct: float) -> str:
        """The sentence of a failed gate: the run's score and what it is a percentage of."""
        if self.name == "rerun":
            return (f"median SSIM {summary['ssim_median']:.4f} is {pct:.2f}% of the BF16 rerun SSIM "
                    f"{summary['ssim_rerun_median']:.4f}")
        return f"median {self.doc} is {pct:.2f}% of the BF16 run's own"


def _pct_of(value: Optional[float], whole: Optional[float]) -> Optional[float]:
    return 100.0 * value / whole if value is not None and whole else None


def target_pct(summary: dict, bf16_own: Optional[float]) -> Optional[float]:
    """``ssim_target_median`` as a percentage of the BF16 reference's SSIM against the correct edits (the summary's
    ``ssim_target_bf16_median`` where the run measured it, else ``bf16_own``: the sweep's BF16 run's score)."""
    own = summary.get("ssim_target_bf16_median") or bf16_own
    return _pct_of(summary.get("ssim_target_median"), own)


def _no_ssim(summary: dict) -> str:
    return "no edit has an SSIM (metrics.ssim=false?)"


def _no_target(summary: dict) -> str:
    if summary.get("ssim_target_median") is None:
        return ("metrics.quality=target and no edit has an SSIM against its correct result (ssim_target): the "
                "workload's manifest names no correct edits; use metrics.quality=rerun or bf16")
    return ("metrics.quality=target and the BF16 run's own SSIM against the correct edits (ssim_target_bf16) is "
            "unknown: run the BF16 configuration in the same sweep")


QUALITY_MEASURES: Registry[QualityMeasure] = Registry("quality measure")
for _measure in (
    QualityMeasure("rerun", "SSIM against the BF16 output, as a share of a second BF16 run's",
                   lambda s, _: s.get("ssim_pct_of_rerun_median"), _no_ssim),
    QualityMeasure("bf16", "SSIM against the BF16 output (the BF16 run's own is 1)",
                   lambda s, _: _pct_of(s.get("ssim_median"), 1.0), _no_ssim),
    QualityMeasure("target", "SSIM against the correct edit", target_pct, _no_target),
):
    QUALITY_MEASURES.register(_measure.name, _measure)


def gate_failure(summary: dict, min_pct: Optional[float], measure: str = "rerun") -> Optional[str]:
    """Why the run fails ``metrics.min_ssim_pct`` on ``metrics.quality``, or None when it passes (or no gate is set)."""
    if min_pct is None:
        return None
    quality = QUALITY_MEASURES.get(measure, "metrics.quality")
    pct = quality.pct(summary, None)
    if pct is None:
        return f"metrics.min_ssim_pct={min_pct:g} is set but {quality.missing(summary)}."
    if pct >= min_pct:
        return None
    return f"SSIM gate failed: {quality.describe(summary, pct)}, below metrics.min_ssim_pct={min_pct:g}."
