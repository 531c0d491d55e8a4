"""The choice a sweep is run for: which runs meet the quality target, the speed/quality Pareto front, and the
fastest run that meets it, with the overrides that run it again (docs/METRICS.md, "The choice").

Every run is judged against one full-quality reference (``full_quality``: BF16, no cache, the reference's steps
and true CFG); the sweep's run of that configuration is the named baseline. Only runs comparable with it (the
same model, workload and reference: ``runs.comparable_key``) and complete are judged; the others are listed
apart with the reason, and never chosen. Quality is ``metrics.quality``'s measure (``metrics/quality.py``) as a
percentage of the reference's score; the target is ``metrics.min_ssim_pct``, or ``quality.DEFAULT_TARGET_PCT``
when unset. Both are read from the sweep's runs, or given to ``ditrun report`` (``--quality``, ``--target-pct``).
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import yaml

from ditrun.errors import UserError
from ditrun.metrics.quality import AUTO, DEFAULT_TARGET_PCT, QUALITY_MEASURES, QualityMeasure, measure_name
from ditrun.metrics.timing import after_warmup
from ditrun.results import files
from ditrun.results.rundir import HYDRA_DIR

if TYPE_CHECKING:
    from ditrun.results.runs import RunResult

PARETO_CHART = "pareto.png"
# Precision labels of runs that quantized nothing (the compute dtype's name).
UNQUANTIZED = ("bf16", "fp16", "fp32")
COLUMNS = (
    "run",
    "layout",
    "precision",
    "cache",
    "world",
    "dit_s",
    "steps_computed",
    "ssim",
    "ssim_pct_of_rerun",
    "psnr_target",
    "margin_db",
    "edits_right_share",
    "quality_pct",
    "meets_target",
    "pareto",
    "status",
    "overrides",
)


@dataclass
class Choice:
    """The sweep's runs judged against one quality target and one baseline."""

    measure: QualityMeasure
    target_pct: float
    pcts: list[Optional[float]]
    """Each run's quality (percent of the full-quality reference's), in the runs' order; None where it has none."""
    meets: list[bool]
    front: list[bool]
    """On the Pareto front: no other judged run is at least as fast and at least as good, and better at one."""
    fastest: Optional[int]
    """The index of the fastest run that meets the target."""
    baseline: Optional[int] = None
    """The index of the sweep's full-quality run (BF16, no cache, the reference's sampling settings)."""
    apart: dict[int, str] = field(default_factory=dict)
    """Runs not judged, by index: why (not comparable with the baseline, incomplete, unreadable)."""
    shortfalls: dict[int, str] = field(default_factory=dict)
    """Runs that fail whatever their percentage (``QualityMeasure.shortfall``), by index."""
    note: Optional[str] = None
    """Why no run could be judged (the measure's one sentence), when none could."""
    as_fast: list[int] = field(default_factory=list)
    """Other runs that meet the target whose median DiT time lies within the fastest one's edits' times (after
    warm-up), fastest first: as fast as the chosen run, as far as its own edits can tell."""
    spread: Optional[tuple[float, float]] = None
    """The fastest run's lowest and highest DiT time per edit after warm-up (``time_spread``)."""

    @property
    def rule(self) -> str:
        return (
            f"{self.measure.doc} at least {self.target_pct:g}% of the full-quality reference's "
            f"(metrics.quality={self.measure.name})"
        )


def quality_settings(runs) -> tuple[str, float]:
    """``metrics.quality`` and the target percentage the sweep's runs were configured with (its first run's)."""
    metrics = next((r.config.get("metrics") for r in runs if r.config.get("metrics")), None) or {}
    target = metrics.get("min_ssim_pct")
    return metrics.get("quality") or AUTO, DEFAULT_TARGET_PCT if target is None else float(target)


def cache_name(run) -> str:
    return run.setting("cache") or "none"


def _sampling(run) -> dict:
    """The run's own steps and true CFG, as ``reference.sampling`` writes them."""
    workload = run.config.get("workload", {})
    scale = workload.get("true_cfg_scale")
    return {"steps": workload.get("steps"), "true_cfg_scale": scale if scale is not None and scale > 1 else "off"}


def is_full_quality(run) -> bool:
    """The run is the reference's configuration: nothing quantized, no cache, the reference's steps and true CFG."""
    reference = run.summary.get("reference")
    same_sampling = reference is None or all(_sampling(run)[k] == reference.get(k) for k in ("steps", "true_cfg_scale"))
    return run.setting("precision") in UNQUANTIZED and cache_name(run) == "none" and same_sampling


def _key_text(run) -> str:
    from ditrun.results.runs import comparable_key

    return json.dumps(comparable_key(run), sort_keys=True, default=str)


def find_baseline(runs) -> tuple[Optional[int], Optional[str]]:
    """(the index of the sweep's full-quality run, its comparable key): of the model, workload and reference most
    complete runs share, the single-process one first, then the sweep's first; without one, (None, that key)."""
    keys = {i: _key_text(r) for i, r in enumerate(runs) if r.complete}
    count = Counter(keys.values())
    if not keys:
        return None, None
    full = [i for i in keys if is_full_quality(runs[i])]
    most = max((count[keys[i]] for i in full), default=0)
    candidates = [i for i in full if count[keys[i]] == most]
    if not candidates:
        return None, count.most_common(1)[0][0]
    best = min(candidates, key=lambda i: (runs[i].setting("layout") != "single", runs[i].setting("world") != 1, i))
    return best, keys[best]


def _difference(run, baseline) -> str:
    """The broadest setting in which ``run`` differs from ``baseline`` (model, workload, reference), in words."""
    from ditrun.results.rundir import differences
    from ditrun.results.runs import comparable_key

    changes = sorted(differences(comparable_key(baseline), comparable_key(run)), key=lambda c: c[0].count("."))
    if not changes:
        return "another configuration"
    key, base, own = changes[0]
    what = {"model": "another model", "workload": "another workload", "reference": "another reference"}[
        key.split(".")[0]
    ]
    return f"{what} ({key}: {_shown(own)}, the baseline's {_shown(base)})"


def _shown(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def set_apart(runs, baseline: Optional[int], key: Optional[str]) -> dict[int, str]:
    """Runs that are not judged, by index, with the reason: incomplete or unreadable, or not comparable."""
    apart = {}
    for i, run in enumerate(runs):
        if not run.complete:
            apart[i] = f"{run.status}: {run.reason}"
        elif key is not None and _key_text(run) != key:
            apart[i] = (
                "not comparable: " + _difference(run, runs[baseline])
                if baseline is not None
                else "not comparable with the sweep's other runs: another model, workload or reference"
            )
    return apart


def pareto_front(points: list[tuple[Optional[float], Optional[float]]]) -> list[bool]:
    """For (seconds, quality) points: which no other point dominates (as fast or faster and as good or better,
    strictly better at one). Points missing either value are not on it."""

    def dominated(i: int) -> bool:
        s, q = points[i]
        return any(
            j != i and s2 is not None and q2 is not None and s2 <= s and q2 >= q and (s2, q2) != (s, q)
            for j, (s2, q2) in enumerate(points)
        )

    return [s is not None and q is not None and not dominated(i) for i, (s, q) in enumerate(points)]


def choose(runs, measure: Optional[str] = None, target_pct: Optional[float] = None) -> Choice:
    """Judge ``runs`` (``runs.RunResult``) against the target; settings not given are the sweep's."""
    configured = quality_settings(runs)
    baseline, key = find_baseline(runs)
    apart = set_apart(runs, baseline, key)
    judged = [i for i in range(len(runs)) if i not in apart]
    name = measure_name(measure or configured[0], [runs[i].summary for i in judged])
    quality = QUALITY_MEASURES.get(name, "metrics.quality")
    target = configured[1] if target_pct is None else target_pct
    own = runs[baseline].summary.get("psnr_target_median") if baseline is not None else None
    pcts = [quality.pct(r.summary, own) if i in judged else None for i, r in enumerate(runs)]
    shortfalls = {i: s for i in judged if (s := quality.shortfall(runs[i].summary))}
    meets = [p is not None and p >= target and i not in shortfalls for i, p in enumerate(pcts)]
    front = pareto_front([(r.dit_s, p) for r, p in zip(runs, pcts)])
    candidates = [i for i, ok in enumerate(meets) if ok and runs[i].dit_s]
    fastest = min(candidates, key=lambda i: runs[i].dit_s, default=None)
    note = quality.missing(runs[judged[0]].summary) if judged and all(pcts[i] is None for i in judged) else None
    spread = time_spread(runs[fastest]) if fastest is not None else None
    as_fast = sorted(
        (i for i in candidates if i != fastest and spread and runs[i].dit_s <= spread[1]), key=lambda i: runs[i].dit_s
    )
    return Choice(quality, target, pcts, meets, front, fastest, baseline, apart, shortfalls, note, as_fast, spread)


def time_spread(run) -> Optional[tuple[float, float]]:
    """The lowest and highest DiT time of a run's edits after warm-up (``metrics.warmup_edits``, as its median
    counts them); None when no record is timed."""
    warmup = (run.config.get("metrics") or {}).get("warmup_edits", 1)
    times = [r["dit_s"] for r in after_warmup(run.records, warmup) if r.get("dit_s")]
    return (min(times), max(times)) if times else None


def rerun_command(run) -> str:
    """The command that runs ``run`` again: ``ditrun`` with its Hydra overrides, quoted for a shell; a run that a
    sweep launcher started (submitit's, on Slurm or here) again through that launcher, as a sweep of one."""
    launcher = launcher_overrides(run.path)
    return " ".join(["ditrun", *(["-m"] if launcher else []), *(shlex.quote(o) for o in launcher + run.overrides)])


def launcher_overrides(run_dir: Path) -> list[str]:
    """The overrides that chose and set the launcher of the sweep that ran ``run_dir`` (``hydra/launcher=slurm``,
    ``hydra.launcher.*``): Hydra keeps them with its own (``.hydra/hydra.yaml``), apart from the run's."""
    try:
        hydra = yaml.safe_load(files.read_text(run_dir / HYDRA_DIR / "hydra.yaml"))
        given = hydra["hydra"]["overrides"]["hydra"]
    except (OSError, UserError, ValueError, RecursionError, yaml.YAMLError, KeyError, TypeError):
        return []
    if not isinstance(given, list):
        return []
    return [o for o in given if isinstance(o, str) and o.startswith(("hydra/launcher=", "hydra.launcher."))]


def steps_cell(run) -> str:
    """Steps computed per edit (median) of the steps: ``5/5`` uncached."""
    steps = run.config.get("workload", {}).get("steps")
    computed = run.summary.get("steps_computed_median")
    if computed is None:
        return "-" if steps is None else f"{steps}/{steps}"
    return f"{computed:g}/{steps}" if steps is not None else f"{computed:g}"


def table_cells(choice: Choice, index: int, run: Optional[RunResult] = None) -> tuple[str, ...]:
    """The report table's last two columns for one run: quality % and whether it meets the target (a run whose
    format ran in its exact emulation says so beside the verdict: its quality is the format's, its time is not)."""
    pct = choice.pcts[index]
    if index in choice.apart:
        mark = choice.apart[index].split(":")[0]  # incomplete, unreadable, not comparable
    else:
        mark = "yes" if choice.meets[index] else ("-" if pct is None else "no")
    if index == choice.fastest:
        mark = "fastest"  # meets it, and is the fastest that does
    if run is not None and emulated_components(run.summary) and mark in ("yes", "no", "fastest"):
        mark += " (emulated)"
    return ("-" if pct is None else f"{pct:.2f}", mark)


EMULATED_BACKENDS = ("emulation", "reference")
"""The backends that compute a format exactly by dequantizing: ``emulation`` (``reference`` in the records of runs
whose attention named it so)."""


def emulated_components(summary: dict) -> list[str]:
    """The components of a run whose quantized format ran in its emulation (``precision_detail``'s backends)."""
    detail = summary.get("precision_detail") or {}
    return [
        name
        for name, part in detail.items()
        if isinstance(part, dict) and set(part.get("backends") or ()) & set(EMULATED_BACKENDS)
    ]


def wandb_rows(runs, choice: Choice) -> list[list]:
    """``COLUMNS`` for every run: what the sweep's W&B table holds."""
    medians = (
        "steps_computed_median",
        "ssim_median",
        "ssim_pct_of_rerun_median",
        "psnr_target_median",
        "margin_db_median",
        "edits_right_share",
    )
    return [
        [
            r.label,
            r.setting("layout"),
            r.setting("precision"),
            cache_name(r),
            r.setting("world"),
            r.dit_s,
            *(r.summary.get(key) for key in medians),
            choice.pcts[i],
            choice.meets[i],
            choice.front[i],
            choice.apart.get(i, "judged"),
            " ".join(r.overrides),
        ]
        for i, r in enumerate(runs)
    ]


def _baseline_line(runs, choice: Choice) -> str:
    if choice.baseline is None:
        return (
            "Baseline: the sweep has no full-quality run (nothing quantized, no cache, the reference's steps); each "
            "run is judged against the cached full-quality reference its summary names."
        )
    best = runs[choice.baseline]
    reference = best.summary.get("reference") or {}
    return (
        f"Baseline (full quality: nothing quantized, no cache, {reference.get('steps', '?')} steps, true CFG "
        f"{reference.get('true_cfg_scale', '?')}): `{best.label}`; every run is judged against the same reference."
    )


def summary_lines(runs, choice: Choice) -> list[str]:
    """What the report says of the choice, one line each (Markdown-safe; commands in backticks)."""
    lines = [_baseline_line(runs, choice)]
    lines += [f"Not judged: `{runs[i].label}`: {reason}." for i, reason in sorted(choice.apart.items())]
    lines += [f"Fails whatever its score: `{runs[i].label}`: {why}." for i, why in sorted(choice.shortfalls.items())]
    if choice.note:
        return lines + [f"Quality target: {choice.rule}. No run can be judged: {choice.note}."]
    judged = len(runs) - len(choice.apart)
    lines.append(f"Quality target: {choice.rule}; {sum(choice.meets)} of {judged} judged runs meet it.")
    if choice.fastest is None:
        return lines + ["No run meets the target."]
    best = runs[choice.fastest]
    return lines + [
        f"Fastest run that meets it: `{best.label}` ({best.dit_s:.4f} s/edit, "
        f"{choice.pcts[choice.fastest]:.2f}%). Run it again with:",
        "",
        f"    {rerun_command(best)}",
        *_as_fast_lines(runs, choice),
    ]


def _as_fast_lines(runs, choice: Choice) -> list[str]:
    """The runs that meet the target as fast as the chosen one within its edits' times, when there are any."""
    if not choice.as_fast:
        return []
    low, high = choice.spread
    others = "; ".join(f"`{runs[i].label}` ({runs[i].dit_s:.4f} s/edit, {choice.pcts[i]:.2f}%)" for i in choice.as_fast)
    return [
        "",
        f"As fast within its edits' DiT times after warm-up ({low:.4f}-{high:.4f} s), and meeting the target too: "
        f"{others}. These times do not tell them apart; more edits (workload.limit) or the published shape would.",
    ]
