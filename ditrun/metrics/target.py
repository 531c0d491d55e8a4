"""Is the edit right? Each edit's output against its correct result, and against the naive outputs it must beat.

SSIM against the correct edit does not answer this: it is mostly structure, and the editor's instructions change
colour, so the input returned unchanged scores higher than a correct output (docs/METRICS.md, "Is the edit
right?"). Three measures do, all on the PNG's 8-bit RGB scaled to [0, 1]:

- ``psnr_target``: PSNR against the correct result (dB, data range 1);
- ``delta_e_target``: the mean CIEDE2000 colour difference from it (scikit-image, CIELAB under D65);
- ``margin_db``: ``psnr_target`` less the best PSNR against the correct result of the naive candidates: the input
  unchanged, and every other known edit of the input. Above 0, the output is closer to the correct result than
  doing nothing and than any wrong edit.

An edit whose correct result is the input (grayscale of a grey picture) cannot be told from doing nothing: it is
marked ``target_equals_input`` and not scored. A candidate equal to the correct result (a mirror of a symmetric
picture beside ``upside_down``) is as right as the target, so it is not a candidate.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Optional

import numpy as np

# Two 8-bit pictures this close are the same picture: an RMS error below a quarter of one level.
SAME_PICTURE_DB = 60.0
PSNR_CAP_DB = 100.0
"""PSNR of identical pictures (infinite) is recorded as this, so every record stays plain JSON."""
# The record's fields against the correct result: the run's output, then the BF16 reference's.
TARGET_FIELDS = (
    "psnr_target",
    "delta_e_target",
    "margin_db",
    "naive_best",
    "target_equals_input",
    "psnr_target_bf16",
    "delta_e_target_bf16",
    "margin_db_bf16",
)
# Summary medians over the scored edits.
MEDIAN_FIELDS = (
    "psnr_target",
    "delta_e_target",
    "margin_db",
    "psnr_target_bf16",
    "delta_e_target_bf16",
    "margin_db_bf16",
)


@dataclass
class Target:
    """An edit's correct result and the naive outputs it must beat: [H, W, 3] uint8 at the output's size."""

    image: np.ndarray
    naive: dict[str, np.ndarray]
    """``input`` (the picture unchanged) and each other known edit of it, by name, less those equal to ``image``."""
    equals_input: bool


def _unit(rgb8: np.ndarray) -> np.ndarray:
    return rgb8.astype(np.float64) / 255.0


def psnr(image: np.ndarray, reference: np.ndarray) -> float:
    """PSNR in dB of two [H, W, 3] uint8 pictures (data range 1); ``PSNR_CAP_DB`` when they are identical."""
    mse = float(np.mean((_unit(image) - _unit(reference)) ** 2))
    return PSNR_CAP_DB if mse == 0 else min(PSNR_CAP_DB, -10.0 * math.log10(mse))


def delta_e(image: np.ndarray, reference: np.ndarray) -> float:
    """Mean CIEDE2000 colour difference of two [H, W, 3] uint8 pictures (0 when identical; about 2.3 is a just
    noticeable difference)."""
    from skimage.color import deltaE_ciede2000, rgb2lab

    return float(np.mean(deltaE_ciede2000(rgb2lab(_unit(image)), rgb2lab(_unit(reference)))))


def make_target(correct: np.ndarray, picture: np.ndarray, edits: dict[str, np.ndarray]) -> Target:
    """The ``Target`` of a correct result, given the input ``picture`` and its known ``edits`` (name -> picture,
    the edit that is correct among them or not), all [H, W, 3] uint8 at the output's size."""
    naive = {"input": picture, **edits}
    kept = {name: image for name, image in naive.items() if psnr(image, correct) < SAME_PICTURE_DB}
    return Target(correct, kept, equals_input="input" not in kept)


def naive_best(target: Target) -> tuple[Optional[str], float]:
    """The naive candidate closest to the correct result, and its PSNR against it (None, -inf without one)."""
    scores = {name: psnr(candidate, target.image) for name, candidate in target.naive.items()}
    best = max(scores, key=scores.get, default=None)
    return best, (scores[best] if best is not None else -math.inf)


def scores(image: np.ndarray, target: Target, best: Optional[tuple[Optional[str], float]] = None) -> dict:
    """``psnr_target``, ``delta_e_target`` and ``margin_db`` of one output (``best``: ``naive_best``, computed
    once for the run's output and its reference's)."""
    value = psnr(image, target.image)
    name, naive_db = best or naive_best(target)
    return {
        "psnr_target": value,
        "delta_e_target": delta_e(image, target.image),
        "margin_db": value - naive_db if name is not None else None,
        "naive_best": name,
    }


def target_fields(image: np.ndarray, target: Optional[Target], bf16: Optional[np.ndarray]) -> dict:
    """``TARGET_FIELDS`` of one edit: the output's scores, and the BF16 reference's (None without ``bf16``); all
    None without a target, and only ``target_equals_input`` set when the correct result is the input."""
    fields = dict.fromkeys(TARGET_FIELDS)
    if target is None:
        return fields
    fields["target_equals_input"] = target.equals_input
    if target.equals_input:
        return fields
    best = naive_best(target)
    fields.update(scores(image, target, best))
    if bf16 is not None:
        reference = scores(bf16, target, best)
        fields.update({f"{key}_bf16": reference[key] for key in ("psnr_target", "delta_e_target", "margin_db")})
    return fields


def _median(values: list[float]) -> Optional[float]:
    return float(statistics.median(values)) if values else None


def _share_right(records: list[dict], key: str) -> Optional[float]:
    margins = [r[key] for r in records if r.get(key) is not None]
    return sum(m > 0 for m in margins) / len(margins) if margins else None


def target_summary(records: list[dict]) -> dict:
    """Medians over the scored edits, the share of them whose output beats every naive candidate
    (``edits_right_share``; ``edits_right_share_bf16`` for the BF16 reference), and how many edits have a correct
    result equal to their input (``edits_target_equals_input``: not scored)."""
    summary = {f"{key}_median": _median([r[key] for r in records if r.get(key) is not None]) for key in MEDIAN_FIELDS}
    summary["edits_right_share"] = _share_right(records, "margin_db")
    summary["edits_right_share_bf16"] = _share_right(records, "margin_db_bf16")
    summary["edits_target_equals_input"] = sum(bool(r.get("target_equals_input")) for r in records)
    return summary


def describe(summary: dict) -> str:
    """One line: how many edits are right and their median PSNR and margin, for the console and the report."""
    share = summary.get("edits_right_share")
    if share is None:
        return "no edit names a correct result"
    parts = [
        f"edits right (beating the input and every other edit): {100 * share:.0f}%",
        f"median PSNR against the correct edit {summary['psnr_target_median']:.2f} dB",
        f"margin {summary['margin_db_median']:+.2f} dB",
    ]
    if summary.get("psnr_target_bf16_median") is not None:
        parts.append(
            f"({(summary.get('reference_dtype') or 'bf16').upper()} reference: "
            f"{100 * summary['edits_right_share_bf16']:.0f}%, "
            f"{summary['psnr_target_bf16_median']:.2f} dB, {summary['margin_db_bf16_median']:+.2f} dB)"
        )
    return ", ".join(parts[:3]) + (" " + parts[3] if len(parts) > 3 else "")


def edit_target(edit) -> Optional[Target]:
    """The ``Target`` of a workload edit (``workload.Edit``) that names its correct result, else None: the
    picture and its known edits at the output's size (``workload.target_image`` gives the correct result)."""
    if edit.target is None:
        return None
    from ditrun.editor.transforms import EDITS, apply
    from ditrun.results.files import to_rgb8
    from ditrun.workload.images import load_image, target_image

    picture = load_image(dataclasses.replace(edit, ref_width=edit.width, ref_height=edit.height))
    edits = {name: to_rgb8(apply(name, picture)) for name in EDITS}
    # A named edit's correct result is one of the picture's edits (``workload.target_image`` would load it again).
    correct = edits.pop(edit.target) if edit.target in edits else target_image(edit)
    return make_target(correct, to_rgb8(picture), edits)
