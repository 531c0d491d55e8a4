"""What each column of ditrun's tables means, said once under the table: the console's table of a run's edits
(``run/console.py``) and the report's table of runs (``metrics/report.py``).

The full-quality reference runs in BF16 on GPUs and in fp32 on CPUs, so its column is named by the dtype it ran
in (``reference_column``), never by what a GPU would have used.
"""

from __future__ import annotations

import textwrap
from typing import Optional

WIDTH = 118
"""Characters per line of a legend (the console's tables are about as wide)."""

REFERENCE = "the full-quality reference (unquantized, uncached; same edit and seed)"

EDIT_COLUMNS = {
    "edit": "the edit's id",
    "size": "the output's width x height",
    "steps": "denoising steps (computed/all where the step cache skipped some)",
    "DiT s": "the edit's DiT time, all steps",
    "s/step": "DiT s per step",
    "exposed %": "share of the DiT time spent waiting on transfers",
    "SSIM": f"against {REFERENCE}",
    "% of rerun": "that SSIM over a second reference run's against the first, in percent",
    "PSNR target": "dB against the correct edit",
    "margin dB": "PSNR target minus that of the best wrong candidate (the input, each other edit): right above 0",
    "dE00": "colour error against the correct edit (CIEDE2000; lower is closer)",
    "image": "the output, in the run directory",
}

# The report's text is parsed by first words in tests: no article "a" here, which could open a wrapped line.
RUN_COLUMNS = {
    "run": "the run's folder, with the overrides that tell it from the others",
    "layout": "how a replica's ranks share a step",
    "precision": "the numeric format (the compute dtype's name: nothing quantized)",
    "transport": "the all-to-all's transport",
    "world": "ranks",
    "DiT s/edit": "median DiT seconds per edit after warm-up",
    "speedup": "the baseline's DiT s/edit over this run's",
    "exposed %": "median share of the DiT time spent waiting on transfers",
    "SSIM": f"median SSIM against {REFERENCE}",
    "rerun SSIM": "the second reference run's SSIM against the first (1.0000 where two runs agree, as on CPUs)",
    "% of rerun": "SSIM over rerun SSIM, in percent",
    "start-up s": "the slowest rank's seconds from its start (a sweep job in the sweep's process: the job's) to its "
    "first denoising step",
    "cache": "the step cache",
    "steps": "denoising steps (computed/all where the step cache skipped some)",
    "PSNR target": "median dB against the correct edit",
    "margin dB": "median margin over the best wrong candidate (the input, each other edit): right above 0",
    "edits right": "share of the edits whose output beats the input and every other edit",
    "quality %": "the run's quality over the full-quality reference's, in percent (docs/METRICS.md, the choice)",
    "meets target": (
        "whether quality % reaches the target (fastest: the fastest run that does; emulated: its format ran in exact "
        "emulation, there being no fast kernel here, so its quality is the format's but its time is not)"
    ),
}


def reference_column(reference_dtype: Optional[str]) -> str:
    """The header of the reference's own score beside the run's: ``(BF16)``, or ``(FP32)`` where it ran in fp32."""
    return f"({(reference_dtype or 'bf16').upper()})"


def legend(header: tuple[str, ...], columns: dict[str, str], reference_dtype: Optional[str] = None) -> str:
    """Every column of ``header`` explained once, as one wrapped paragraph."""
    reference = reference_column(reference_dtype)
    explained = {
        **columns,
        reference: f"the full-quality reference's PSNR target (it ran in {reference_dtype or 'bf16'})",
    }
    text = "; ".join(f"{name}: {explained[name]}" for name in header) + "."
    return textwrap.fill(text, WIDTH, break_on_hyphens=False)
