"""Image quality: SSIM of each edit's image against its BF16 reference, the measures against the correct edit
(``metrics/target.py``), and the quality gate.

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

from ditrun.metrics.target import TARGET_FIELDS, Target, target_fields, target_summary
from ditrun.registry import Registry

SSIM_FIELDS = ("ssim", "ssim_rerun", "ssim_pct_of_rerun", "ssim_target", "ssim_target_bf16")
# A record's quality fields, in its order: against the BF16 reference, then against the correct edit
# (``metrics/target.py``), then SSIM against the correct edit (structure only: it does not say whether the edit is
# right).
QUALITY_FIELDS = (*SSIM_FIELDS[:3], *TARGET_FIELDS, *SSIM_FIELDS[3:])
DEFAULT_TARGET_PCT = 98.0
"""The quality target when ``metrics.min_ssim_pct`` is unset: within 2% of the full-quality reference's score."""


class QualityGateError(RuntimeError):
    """A verdict on the run's quality, in one sentence: it is below ``metrics.min_ssim_pct`` (the message says by
    how much) or fewer of its edits are right than the reference's, or an edit's reference is broken
    (``reference.BrokenReference``). Exit status 1."""


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


def quality_fields(image: np.ndarray, reference, target: Optional[Target] = None) -> dict:
    """The quality fields of one edit's record; those against the BF16 reference are None when SSIM is off
    (``reference`` is None), those against the correct result None when the edit names none (``target``)."""
    fields = dict.fromkeys(QUALITY_FIELDS)
    fields.update(target_fields(image, target, None if reference is None else reference.image))
    if target is not None:
        fields["ssim_target"] = ssim(image, target.image)
        fields["ssim_target_bf16"] = None if reference is None else ssim(reference.image, target.image)
    if reference is None:
        return fields
    value = ssim(image, reference.image)
    rerun = ssim(reference.rerun, reference.image)
    fields.update(ssim=value, ssim_rerun=rerun, ssim_pct_of_rerun=100.0 * value / rerun if rerun > 0 else None)
    return fields


def quality_summary(records: list[dict]) -> dict:
    """Medians over every edit (warm-up changes timings, not images)."""
    summary = {}
    for key in SSIM_FIELDS:
        values = [r[key] for r in records if r.get(key) is not None]
        summary[f"{key}_median"] = float(statistics.median(values)) if values else None
    return {**summary, **target_summary(records)}


@dataclass(frozen=True)
class QualityMeasure:
    """One ``metrics.quality``: what judges a run, as a percentage of the full-quality reference's score on it."""

    name: str
    doc: str
    pct: Callable[[dict, Optional[float]], Optional[float]]
    """(the run's summary, the reference's score where the summary lacks it) -> percentage, or None."""
    missing: Callable[[dict], str]
    """(the run's summary) -> why it has no percentage, said when one is asked for."""
    shortfall: Callable[[dict], Optional[str]] = lambda summary: None
    """(the run's summary) -> why it fails whatever its percentage (edits that stopped being right), or None."""

    def describe(self, summary: dict, pct: float) -> str:
        """The sentence of a failed gate: the run's score and what it is a percentage of."""
        if self.name == "rerun":
            return (
                f"median SSIM {summary['ssim_median']:.4f} is {pct:.2f}% of the full-quality rerun's SSIM "
                f"{summary['ssim_rerun_median']:.4f}"
            )
        if self.name == "target":
            return (
                f"median PSNR against the correct edit {summary['psnr_target_median']:.2f} dB is {pct:.2f}% of "
                f"the full-quality reference's {summary['psnr_target_bf16_median']:.2f} dB"
            )
        return f"median {self.doc} is {pct:.2f}% of the full-quality reference's"


def _pct_of(value: Optional[float], whole: Optional[float]) -> Optional[float]:
    return 100.0 * value / whole if value is not None and whole else None


def target_pct(summary: dict, reference_psnr: Optional[float]) -> Optional[float]:
    """``psnr_target_median`` as a percentage of the full-quality reference's PSNR against the correct edits (the
    summary's ``psnr_target_bf16_median``, else ``reference_psnr``: a report's baseline run's)."""
    own = summary.get("psnr_target_bf16_median") or reference_psnr
    return _pct_of(summary.get("psnr_target_median"), own)


def fewer_edits_right(summary: dict) -> Optional[str]:
    """Why a run fails ``target`` whatever its PSNR: a smaller share of its edits beats every naive candidate (the
    input unchanged, any other known edit) than of the full-quality reference's, or none does."""
    share, reference = summary.get("edits_right_share"), summary.get("edits_right_share_bf16")
    if share is None:
        return None
    if share == 0 or (reference is not None and share < reference):
        against = "" if reference is None else f", against {100 * reference:.0f}% for the full-quality reference"
        return f"{100 * share:.0f}% of its edits beat doing nothing and every wrong edit (margin above 0 dB){against}"
    return None


def _no_ssim(summary: dict) -> str:
    return "no edit has an SSIM (metrics.ssim=false?)"


def _no_target(summary: dict) -> str:
    if summary.get("psnr_target_median") is None:
        return (
            "metrics.quality=target and no edit is scored against a correct result: the workload names no "
            "edit's target (or every target equals its input); use metrics.quality=rerun or bf16"
        )
    return (
        "metrics.quality=target and the full-quality reference's PSNR against the correct edits "
        "(psnr_target_bf16) is unknown: it needs metrics.ssim=true, or a full-quality run in the same sweep"
    )


AUTO = "auto"
QUALITY_MEASURES: Registry[QualityMeasure] = Registry("quality measure")
for _measure in (
    QualityMeasure(
        "rerun",
        "SSIM against the full-quality output, as a share of a second full-quality run's",
        lambda s, _: s.get("ssim_pct_of_rerun_median"),
        _no_ssim,
    ),
    QualityMeasure(
        "bf16",
        "SSIM against the full-quality output (the reference's own is 1)",
        lambda s, _: _pct_of(s.get("ssim_median"), 1.0),
        _no_ssim,
    ),
    QualityMeasure(
        "target", "PSNR against the correct edit, with as many edits right", target_pct, _no_target, fewer_edits_right
    ),
):
    QUALITY_MEASURES.register(_measure.name, _measure)


def measure_name(name: str, summaries: list[dict]) -> str:
    """``metrics.quality`` as it judges: ``auto`` is ``target`` when the runs' edits are scored against correct
    results (the workload names them), else ``rerun``."""
    if name != AUTO:
        return name
    return "target" if any(s.get("psnr_target_median") is not None for s in summaries) else "rerun"


def check_measure(name: str) -> None:
    """A mistyped ``metrics.quality`` is one sentence naming the allowed ones."""
    if name != AUTO and name not in QUALITY_MEASURES:
        raise QUALITY_MEASURES.unknown(name, "metrics.quality", extra=AUTO)


def gate_failure(summary: dict, min_pct: Optional[float], measure: str = AUTO) -> Optional[str]:
    """Why the run fails ``metrics.min_ssim_pct`` on ``metrics.quality``, or None when it passes (or no gate is set)."""
    if min_pct is None:
        return None
    quality = QUALITY_MEASURES.get(measure_name(measure, [summary]), "metrics.quality")
    pct = quality.pct(summary, None)
    if pct is None:
        return f"metrics.min_ssim_pct={min_pct:g} is set but {quality.missing(summary)}."
    shortfall = quality.shortfall(summary)
    if shortfall is not None:
        return f"quality gate failed: {shortfall} (metrics.quality={quality.name})."
    if pct >= min_pct:
        return None
    return f"quality gate failed: {quality.describe(summary, pct)}, below metrics.min_ssim_pct={min_pct:g}."
