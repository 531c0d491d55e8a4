"""The choice a sweep is run for: which runs meet the quality target, the speed/quality Pareto front, and the
fastest run that meets the target, with the overrides that run it again (docs/METRICS.md, "The choice").

Quality is ``metrics.quality``'s measure (``metrics/quality.py``) as a percentage of the BF16 run's own
score; the target is ``metrics.min_ssim_pct``, or 98 (within 2%) when unset. Both are read from the
sweep's runs, or given to ``ditrun report`` (``--quality``, ``--target-pct``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Optional

from ditrun.metrics.quality import DEFAULT_TARGET_PCT, QUALITY_MEASURES, QualityMeasure

PARETO_CHART = "pareto.png"
# Precision labels of runs that quantized nothing (the compute dtype's name).
UNQUANTIZED = ("bf16", "fp16", "fp32")
COLUMNS = ("run", "layout", "precision", "cache", "world", "dit_s", "steps_computed", "ssim", "ssim_pct_of_rerun",
           "ssim_target", "quality_pct", "meets_target", "pareto", "overrides")


@dataclass
class Choice:
    """The sweep's runs judged against one quality target."""

    measure: QualityMeasure
    target_pct: float
    pcts: list[Optional[float]]
    """Each run's quality (percent of the BF16 run's own), in the runs' order; None where it has none."""
    meets: list[bool]
    front: list[bool]
    """On the Pareto front: no other run is at least as fast and at least as good, and better at one."""
    fastest: Optional[int]
    """The index of the fastest run that meets the target."""
    note: Optional[str] = None
    """Why no run could be judged (the measure's one sentence), when none could."""

    @property
    def rule(self) -> str:
        return (f"{self.measure.doc} at least {self.target_pct:g}% of the BF16 run's own "
                f"(metrics.quality={self.measure.name})")


def quality_settings(runs) -> tuple[str, float]:
    """``metrics.quality`` and the target percentage the sweep's runs were configured with (its first run's)."""
    metrics = next((r.summary.get("config", {}).get("metrics") for r in runs if r.summary.get("config")), None) or {}
    target = metrics.get("min_ssim_pct")
    return metrics.get("quality") or "rerun", DEFAULT_TARGET_PCT if target is None else float(target)


def cache_name(run) -> str:
    return run.setting("cache") or "none"


def bf16_own_target(runs) -> Optional[float]:
    """The BF16 run's own SSIM against the correct edits: that of the sweep's unquantized, uncached run (the
    single-process one first)."""
    plain = [r for r in runs if r.setting("precision") in UNQUANTIZED and cache_name(r) == "none"
             and r.summary.get("ssim_target_median") is not None]
    plain.sort(key=lambda r: (r.setting("layout") != "single", r.setting("world") != 1))
    return plain[0].summary["ssim_target_median"] if plain else None


def pareto_front(points: list[tuple[Optional[float], Optional[float]]]) -> list[bool]:
    """For (seconds, quality) points: which no other point dominates (as fast or faster and as good or better,
    strictly better at one). Points missing either value are not on it."""
    def dominated(i: int) -> bool:
        s, q = points[i]
        return any(j != i and s2 is not None and q2 is not None and s2 <= s and q2 >= q and (s2, q2) != (s, q)
                   for j, (s2, q2) in enumerate(points))

    return [s is not None and q is not None and not dominated(i) for i, (s, q) in enumerate(points)]


def choose(runs, measure: Optional[str] = None, target_pct: Optional[float] = None) -> Choice:
    """Judge ``runs`` (``report.RunResult``) against the target; settings not given are the sweep's."""
    configured = quality_settings(runs)
    quality = QUALITY_MEASURES.get(measure or configured[0], "metrics.quality")
    target = configured[1] if target_pct is None else target_pct
    own = bf16_own_target(runs)
    pcts = [quality.pct(r.summary, own) for r in runs]
    meets = [p is not None and p >= target and r.summary.get("complete", True) is not False
             for r, p in zip(runs, pcts)]
    front = pareto_front([(r.dit_s, p) for r, p in zip(runs, pcts)])
    candidates = [i for i, ok in enumerate(meets) if ok and runs[i].dit_s]
    fastest = min(candidates, key=lambda i: runs[i].dit_s, default=None)
    note = quality.missing(runs[0].summary) if all(p is None for p in pcts) and runs else None
    return Choice(quality, target, pcts, meets, front, fastest, note)


def rerun_command(run) -> str:
    """The command that runs ``run`` again: ``ditrun`` with its Hydra overrides, quoted for a shell."""
    return " ".join(["ditrun", *(shlex.quote(o) for o in run.overrides)])


def steps_cell(run) -> str:
    """Steps computed per edit (median) of the steps: ``5/5`` uncached."""
    steps = run.summary.get("config", {}).get("workload", {}).get("steps")
    computed = run.summary.get("steps_computed_median")
    if computed is None:
        return "-" if steps is None else f"{steps}/{steps}"
    return f"{computed:g}/{steps}" if steps is not None else f"{computed:g}"


def table_cells(choice: Choice, index: int) -> tuple[str, ...]:
    """The report table's last two columns for one run: quality % and whether it meets the target."""
    pct = choice.pcts[index]
    mark = "yes" if choice.meets[index] else ("-" if pct is None else "no")
    if index == choice.fastest:
        mark = "fastest"  # meets it, and is the fastest that does
    return ("-" if pct is None else f"{pct:.2f}", mark)


def wandb_rows(runs, choice: Choice) -> list[list]:
    """``COLUMNS`` for every run: what the sweep's W&B table holds."""
    medians = ("steps_computed_median", "ssim_median", "ssim_pct_of_rerun_median", "ssim_target_median")
    return [[r.label, r.setting("layout"), r.setting("precision"), cache_name(r), r.setting("world"), r.dit_s,
             *(r.summary.get(key) for key in medians), choice.pcts[i], choice.meets[i], choice.front[i],
             " ".join(r.overrides)] for i, r in enumerate(runs)]


def summary_lines(runs, choice: Choice) -> list[str]:
    """What the report says of the choice, one line each (Markdown-safe; commands in backticks)."""
    if choice.note:
        return [f"Quality target: {choice.rule}. No run can be judged: {choice.note}."]
    lines = [f"Quality target: {choice.rule}; {sum(choice.meets)} of {len(runs)} runs meet it."]
    if choice.fastest is None:
        return lines + ["No run meets the target."]
    best = runs[choice.fastest]
    return lines + [f"Fastest run that meets it: `{best.label}` ({best.dit_s:.4f} s/edit, "
                    f"{choice.pcts[choice.fastest]:.2f}%). Run it again with:", "",
                    f"    {rerun_command(best)}"]
