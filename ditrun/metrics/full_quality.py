"""The full-quality configuration every verdict compares against: BF16, no cache, the full-quality step count and
true CFG, whatever the run itself trades away (docs/METRICS.md, "One full-quality reference").

A run is never graded against a full-quality output made with its own shortcuts. Precision and the step cache never
reach it (it is always BF16 and uncached); the sampling settings that trade quality for speed are the ``TRADED``
keys, each with a ``metrics.full_quality_*`` key. Unset, the full-quality output takes the run's own value, and in
a Hydra sweep that varies the setting, the sweep's best: the most steps, the strongest true CFG. So every run of
``ditrun -m workload.steps=1,8`` is judged against the 8-step full-quality output, and the 1-step run cannot meet a
target that 8 steps meet.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from ditrun.errors import UserError

# workload key traded for speed -> (the metrics key naming the full-quality output's value, the best of several values).
TRADED: dict[str, tuple[str, Callable[[list], object]]] = {
    "workload.steps": ("metrics.full_quality_steps", max),
    "workload.true_cfg_scale": ("metrics.full_quality_true_cfg_scale", max),
}
SWEEP_FILE = "multirun.yaml"


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _set(cfg, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[leaf] = value


def full_quality_steps(cfg) -> int:
    """The full-quality output's denoising steps: ``metrics.full_quality_steps``, else the run's own."""
    steps = cfg.metrics.full_quality_steps
    return cfg.workload.steps if steps is None else steps


def full_quality_true_cfg_scale(cfg) -> float:
    """The full-quality output's true CFG scale: ``metrics.full_quality_true_cfg_scale``, else the run's own."""
    scale = cfg.metrics.full_quality_true_cfg_scale
    return cfg.workload.true_cfg_scale if scale is None else scale


def full_quality_workload(cfg):
    """``cfg.workload`` with the full-quality output's sampling settings: what the full-quality pass renders with."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(
        cfg.workload, {"steps": full_quality_steps(cfg), "true_cfg_scale": full_quality_true_cfg_scale(cfg)}
    )


def check_config(cfg) -> None:
    """Mistakes in the ``metrics.full_quality_*`` keys, one sentence each."""
    steps = cfg.metrics.full_quality_steps
    if steps is not None and steps < 1:
        raise UserError(
            f"metrics.full_quality_steps={steps} must be 1 or more (or unset for the run's own workload.steps)."
        )
    scale = cfg.metrics.full_quality_true_cfg_scale
    if scale is not None and not math.isfinite(scale):
        raise UserError(
            f"metrics.full_quality_true_cfg_scale={scale} must be a finite number (or unset for the "
            "run's own workload.true_cfg_scale)."
        )


def swept_values(sweep_dir: Path) -> dict[str, list]:
    """The values each ``TRADED`` key takes across the Hydra sweep whose directory is ``sweep_dir`` (read from the
    ``multirun.yaml`` Hydra's sweeper saves there before the first job); only keys the sweep varies."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    path = Path(sweep_dir) / SWEEP_FILE
    if not path.is_file():
        return {}
    hydra = OmegaConf.load(path).hydra
    arguments = [f"{key}={value}" for key, value in (hydra.sweeper.get("params") or {}).items()]
    arguments += list(hydra.overrides.task)
    found = {}
    for override in OverridesParser.create().parse_overrides(arguments):
        if override.key_or_group in TRADED and override.is_sweep_override():
            found[override.key_or_group] = list(override.sweep_iterator())
    return found


def apply_sweep_defaults(cfg, sweep_dir) -> None:
    """In a Hydra multirun: each ``metrics.full_quality_*`` left unset takes the sweep's best value of the setting it
    stands for, when the sweep varies that setting (so every job of the sweep shares one full-quality output)."""
    for key, values in swept_values(Path(sweep_dir)).items():
        full_quality_key, best = TRADED[key]
        if _get(cfg, full_quality_key) is None:
            _set(cfg, full_quality_key, best([type(_get(cfg, key))(v) for v in values]))


def description(cfg) -> dict:
    """The full-quality output's sampling settings, as records and summaries carry them (``reference``)."""
    return {
        "steps": full_quality_steps(cfg),
        "true_cfg_scale": full_quality_true_cfg_scale(cfg),
        "dtype": cfg.metrics.full_quality_dtype,
    }
