"""``ditrun report PATH``: compare the runs under a run or multirun directory.

Reads only ditrun's own files (``summary.json``, ``edits.jsonl`` and Hydra's
``.hydra/overrides.yaml`` of each run), so it needs no W&B at all. Prints one row per run and
writes ``report.md`` with two charts next to it: ``dit_time.png`` (median DiT seconds per
edit, split into compute and exposed transfer) and ``ssim.png`` (SSIM per precision).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml
from hydra.experimental.callback import Callback

from ditrun.metrics.results import EDITS_FILE, SUMMARY_FILE, finished_edits
from ditrun.metrics.strip import STRIP_CHART, write_strip
from ditrun.errors import UserError

# Precision labels of runs that quantized nothing (the compute dtype's name): the speedup baseline.
UNQUANTIZED = ("bf16", "fp16", "fp32")
REPORT_FILE = "report.md"
DIT_CHART = "dit_time.png"
SSIM_CHART = "ssim.png"
HEADER = ("run", "layout", "precision", "transport", "world", "DiT s/edit", "speedup", "exposed %", "SSIM",
          "rerun SSIM", "% of rerun", "start-up s")


@dataclass
class RunResult:
    """What the report needs of one run directory."""

    path: Path
    label: str
    summary: dict
    records: list[dict]
    overrides: list[str] = field(default_factory=list)

    def setting(self, key: str):
        """``layout`` / ``transport`` / ``world`` as the run's config had it; ``precision`` as it ran."""
        config = self.summary.get("config", {})
        if key == "precision" and "precision" in self.summary:
            return self.summary["precision"]
        if key == "world":
            return config.get("launcher", {}).get("world")
        return config.get(key, {}).get("name")

    @property
    def dit_s(self) -> Optional[float]:
        return self.summary.get("dit_s_median")

    @property
    def exposed_s(self) -> float:
        return self.summary.get("exposed_transfer_s_median") or 0.0


def find_runs(root: Path) -> list[Path]:
    """``root`` itself when it is a run directory, else every run directory below it, sweep jobs in order."""
    if (root / SUMMARY_FILE).is_file():
        return [root]
    found = [p.parent for p in root.rglob(SUMMARY_FILE) if "wandb" not in p.relative_to(root).parts]
    return sorted(found, key=lambda p: [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.relative_to(root).parts])


def load_run(path: Path, root: Path) -> RunResult:
    summary = json.loads((path / SUMMARY_FILE).read_text())
    records = list(finished_edits(path).values()) if (path / EDITS_FILE).is_file() else []
    overrides_file = path / ".hydra" / "overrides.yaml"
    overrides = (yaml.safe_load(overrides_file.read_text()) or []) if overrides_file.is_file() else []
    label = str(path.relative_to(root)) if path != root else path.name
    return RunResult(path, label, summary, records, [str(o) for o in overrides])


def label_with_overrides(runs: list[RunResult]) -> None:
    """Append to each label the overrides that tell the runs apart (those not shared by all)."""
    shared = set.intersection(*(set(r.overrides) for r in runs)) if runs else set()
    for run in runs:
        distinct = [o for o in run.overrides if o not in shared]
        if distinct:
            run.label = f"{run.label}: {' '.join(distinct)}"


def choose_baseline(runs: list[RunResult], baseline: Optional[str]) -> Optional[RunResult]:
    """``--baseline`` (a run's label), else the slowest single-process BF16 run, else the slowest run."""
    if baseline is not None:
        match = [r for r in runs if baseline in (r.label, r.label.split(":")[0])]
        if not match:
            raise UserError(f"--baseline {baseline!r} names no run; runs: {', '.join(r.label for r in runs)}.")
        return match[0]
    timed = [r for r in runs if r.dit_s]
    plain = [r for r in timed if (r.setting("layout"), r.setting("world")) == ("single", 1)
             and r.setting("precision") in UNQUANTIZED]
    return max(plain or timed, key=lambda r: r.dit_s, default=None)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(runs: list[RunResult], baseline: Optional[RunResult]) -> list[tuple[str, ...]]:
    rows = [HEADER]
    for r in runs:
        speedup = baseline.dit_s / r.dit_s if baseline is not None and baseline.dit_s and r.dit_s else None
        s = r.summary
        marks = (" (baseline)" if r is baseline else "") + (" FAILED" if s.get("failure") else "")
        rows.append((r.label + marks, str(r.setting("layout")),
                     str(r.setting("precision")), str(r.setting("transport")), str(r.setting("world")),
                     _fmt(r.dit_s, ".4f"), _fmt(speedup, ".2f") + ("x" if speedup else ""),
                     _fmt(s.get("exposed_transfer_pct_median"), ".1f"), _fmt(s.get("ssim_median"), ".4f"),
                     _fmt(s.get("ssim_rerun_median"), ".4f"), _fmt(s.get("ssim_pct_of_rerun_median"), ".2f"),
                     _fmt(s.get("startup_s_max"), ".1f")))
    return rows


def format_text(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_markdown(rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def _pyplot():
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # Hydra's logging would show its font cache notes

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_dit_time(runs: list[RunResult], path: Path) -> None:
    """Stacked bars: median DiT seconds per edit = compute + exposed transfer."""
    plt = _pyplot()
    timed = [r for r in runs if r.dit_s]
    labels = [r.label for r in timed]
    exposed = [min(r.exposed_s, r.dit_s) for r in timed]
    compute = [r.dit_s - e for r, e in zip(timed, exposed)]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(timed) + 2), 4.0))
    ax.bar(labels, compute, width=0.6, label="compute")
    ax.bar(labels, exposed, width=0.6, bottom=compute, label="exposed transfer")
    ax.set_xlim(-0.75, len(timed) - 0.25)
    ax.set_ylim(0, 1.3 * max((r.dit_s for r in timed), default=1.0))  # room for the legend
    ax.set_ylabel("median DiT seconds per edit")
    ax.set_title("DiT time per edit")
    ax.legend()
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ssim(runs: list[RunResult], path: Path) -> bool:
    """Per-edit SSIM of each run, grouped by precision, with the BF16 rerun SSIM as a line; False if no SSIM."""
    scored = [r for r in runs if any(e.get("ssim") is not None for e in r.records)]
    if not scored:
        return False
    plt = _pyplot()
    precisions = sorted({str(r.setting("precision")) for r in scored})
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 * len(precisions) + 2), 4.0))
    for r in scored:
        x = precisions.index(str(r.setting("precision")))
        values = [e["ssim"] for e in r.records if e.get("ssim") is not None]
        ax.scatter([x] * len(values), values, alpha=0.7, label=r.label)
    rerun = [r.summary.get("ssim_rerun_median") for r in scored if r.summary.get("ssim_rerun_median") is not None]
    if rerun:
        ax.axhline(min(rerun), linestyle="--", color="gray", label="BF16 rerun")
    ax.set_xticks(range(len(precisions)), precisions)
    ax.set_xlim(-0.5, len(precisions) - 0.5)
    ax.set_ylabel("SSIM vs BF16 reference")
    ax.set_title("SSIM per precision")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def markdown_report(runs: list[RunResult], rows, baseline: Optional[RunResult], has_ssim: bool) -> str:
    parts = ["# ditrun report", "", format_markdown(rows), ""]
    if baseline is not None:
        parts += [f"Speedup is relative to `{baseline.label}`. DiT time is the median over the edits after "
                  "warm-up; exposed transfer is the time the compute stream waited on the transport.", ""]
    parts += [f"![DiT time per edit]({DIT_CHART})", ""]
    parts += [f"![SSIM per precision]({SSIM_CHART})" if has_ssim else "No run computed SSIM (metrics.ssim=false).", ""]
    parts += ["## Runs", ""]
    for r in runs:
        s = r.summary
        parts.append(f"- `{r.label}`: {len(r.records)} edits, {s.get('device')} ({s.get('dtype')}), "
                     f"torch {s.get('torch')}, git {s.get('git')}" + (f", **failed**: {s['failure']}" if s.get("failure") else ""))
    return "\n".join(parts) + "\n"


def write_report(root: Path, out_dir: Optional[Path] = None, baseline: Optional[str] = None) -> tuple[str, Path]:
    """Write ``report.md`` and the charts for the runs under ``root``; returns (text table, report path)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; give a ditrun run or multirun directory.")
    runs = [load_run(p, root) for p in find_runs(root)]
    if not runs:
        raise UserError(f"{root} holds no ditrun run (no {SUMMARY_FILE} in it or below it).")
    label_with_overrides(runs)
    chosen = choose_baseline(runs, baseline)
    rows = table_rows(runs, chosen)
    out_dir = Path(out_dir) if out_dir else root
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_dit_time(runs, out_dir / DIT_CHART)
    has_ssim = plot_ssim(runs, out_dir / SSIM_CHART)
    strip = write_strip(runs[0].path, out_dir / STRIP_CHART, _pyplot()) if len(runs) == 1 else None
    text = markdown_report(runs, rows, chosen, has_ssim)
    if strip is not None:
        text += f"\n![reference, instruction, output and correct edit of each edit]({STRIP_CHART})\n"
    report = out_dir / REPORT_FILE
    report.write_text(text)
    return format_text(rows), report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ditrun report", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a ditrun run directory or a multirun (sweep) directory")
    parser.add_argument("--out", type=Path, default=None, help="where report.md and the charts go (default: PATH)")
    parser.add_argument("--baseline", default=None, help="the run the speedup is relative to (its label)")
    args = parser.parse_args(argv)
    try:
        text, report = write_report(args.path, args.out, args.baseline)
    except UserError as err:
        print(f"ditrun: error: {err}", file=sys.stderr)
        return 2
    print(text)
    print(f"report: {report}")
    return 0


class SweepReport(Callback):
    """Hydra callback: when a multirun ends, write its report into the sweep directory."""

    def on_multirun_end(self, config, **kwargs) -> None:
        if not config.metrics.report:
            return
        try:
            text, report = write_report(Path(config.hydra.sweep.dir))
        except UserError as err:  # every job failed before writing a summary
            print(f"ditrun: no sweep report: {err}", file=sys.stderr)
            return
        print(text)
        print(f"sweep report: {report}", flush=True)
