"""What a run measures (timing, exposed transfer, SSIM) and where it goes (results files, W&B, reports)."""

from __future__ import annotations

import math

from ditrun.errors import UserError


def check_config(cfg) -> None:
    """Mistakes in ``metrics.*`` and ``wandb.*``, raised before any model is built."""
    from ditrun.devices import DTYPES
    from ditrun.metrics import full_quality
    from ditrun.metrics import wandb as wandb_log
    from ditrun.metrics.quality import check_measure

    metrics = cfg.metrics
    if metrics.warmup_edits < 0:
        raise UserError(f"metrics.warmup_edits={metrics.warmup_edits} must be 0 or more.")
    if metrics.full_quality_dtype is not None and metrics.full_quality_dtype not in DTYPES:
        raise UserError(
            f"metrics.full_quality_dtype={metrics.full_quality_dtype!r} is unknown; "
            f"allowed: {', '.join(DTYPES)} (or unset for the run's own dtype)."
        )
    if metrics.min_ssim_pct is not None and not metrics.ssim:
        raise UserError(f"metrics.min_ssim_pct={metrics.min_ssim_pct:g} needs metrics.ssim=true.")
    if metrics.min_ssim_pct is not None and not 0 < metrics.min_ssim_pct < math.inf:
        raise UserError(f"metrics.min_ssim_pct={metrics.min_ssim_pct:g} must be a percentage above 0.")
    check_measure(metrics.quality)
    full_quality.check_config(cfg)
    wandb_log.check_config(cfg.wandb)
