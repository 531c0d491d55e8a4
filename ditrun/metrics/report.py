"""``ditrun report PATH``: compare the runs under a run or multirun directory.

Reads only ditrun's own files (``summary.json``, ``edits.jsonl`` and Hydra's
``.hydra/overrides.yaml`` of each run), so it needs no W&B at all. Prints one row per run and
writes ``report.md`` with two charts next to it: ``dit_time.png`` (median DiT seconds per
edit, split into compute and exposed transfer) and ``ssim.png`` (SSIM per precision). Of several
runs it also makes the choice (``metrics/choice.py``): which meet the quality target, the
speed/quality Pareto front (``pareto.png``), and the fastest that meets it with its command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from hydra.experimental.callback import Callback

from ditrun.errors import UserError
from ditrun.metrics import choice as choosing
from ditrun.metrics.columns import RUN_COLUMNS, legend
from ditrun.metrics.strip import STRIP_CHART, write_strip
from ditrun.results import files
from ditrun.results.runs import RunResult, load_runs

# Precision labels of runs that quantized nothing (the compute dtype's name): the speedup baseline.
REPORT_FILE = "report.md"
DIT_CHART = "dit_time.png"
SSIM_CHART = "ssim.png"
HEADER = (
    "run",
    "layout",
    "precision",
    "transport",
    "world",
    "DiT s/edit",
    "speedup",
    "exposed %",
    "SSIM",
    "rerun SSIM",
    "% of rerun",
    "start-up s",
    "cache",
    "steps",
    "PSNR target",
    "margin dB",
    "edits right",
    "quality %",
    "meets target",
)


def choose_baseline(
    runs: list[RunResult], baseline: Optional[str], choice: Optional[choosing.Choice] = None
) -> Optional[RunResult]:
    """``--baseline`` (a run's label), else the choice's full-quality run, else the slowest single-process uncached
    BF16 run, else the slowest run: the run speedups are relative to."""
    if baseline is not None:
        match = [r for r in runs if baseline in (r.label, r.label.split(":")[0])]
        if not match:
            raise UserError(f"--baseline {baseline!r} names no run; runs: {', '.join(r.label for r in runs)}.")
        return match[0]
    if choice is not None and choice.baseline is not None:
        return runs[choice.baseline]
    timed = [r for r in runs if r.dit_s]
    plain = [
        r
        for r in timed
        if (r.setting("layout"), r.setting("world")) == ("single", 1)
        and r.setting("precision") in choosing.UNQUANTIZED
        and choosing.cache_name(r) == "none"
    ]
    return max(plain or timed, key=lambda r: r.dit_s, default=None)


def _fmt(value, spec: str) -> str:
    """A number of a run's files as the table shows it; anything else there (absent, or not a number) is "-"."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _share(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table_rows(
    runs: list[RunResult], baseline: Optional[RunResult], choice: Optional[choosing.Choice] = None
) -> list[tuple[str, ...]]:
    choice = choice or choosing.choose(runs)
    rows = [HEADER]
    for i, r in enumerate(runs):
        speedup = baseline.dit_s / r.dit_s if baseline is not None and baseline.dit_s and r.dit_s else None
        s = r.summary
        marks = (" (baseline)" if r is baseline else "") + (" FAILED" if s.get("failure") else "")
        rows.append(
            (
                r.label + marks,
                str(r.setting("layout")),
                str(r.setting("precision")),
                str(r.setting("transport")),
                str(r.setting("world")),
                _fmt(r.dit_s, ".4f"),
                _fmt(speedup, ".2f") + ("x" if speedup else ""),
                _fmt(s.get("exposed_transfer_pct_median"), ".1f"),
                _fmt(s.get("ssim_median"), ".4f"),
                _fmt(s.get("ssim_rerun_median"), ".4f"),
                _fmt(s.get("ssim_pct_of_rerun_median"), ".2f"),
                _fmt(s.get("startup_s_max"), ".1f"),
                choosing.cache_name(r),
                choosing.steps_cell(r),
                _fmt(s.get("psnr_target_median"), ".2f"),
                _fmt(s.get("margin_db_median"), "+.2f"),
                _share(s.get("edits_right_share")),
                *choosing.table_cells(choice, i, r),
            )
        )
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


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    files.save_figure(fig, path)
    plt.close(fig)


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
    _save(plt, fig, path)


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
    _save(plt, fig, path)
    return True


def plot_pareto(runs, choice: choosing.Choice, path: Path) -> bool:
    """Quality against DiT time per run, the Pareto front as a line, the target as a dashed line, the chosen run
    ringed; False (no chart) when no run has both."""
    points = [(r.dit_s, p, r.label, i) for i, (r, p) in enumerate(zip(runs, choice.pcts)) if r.dit_s and p is not None]
    if not points:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    for s, p, label, i in points:
        ax.scatter([s], [p], color="tab:green" if choice.meets[i] else "tab:red", zorder=3)
        ax.annotate(label.split(":")[0], (s, p), textcoords="offset points", xytext=(4, 4), fontsize="small")
    front = sorted((s, p) for s, p, _, i in points if choice.front[i])
    ax.plot([s for s, _ in front], [p for _, p in front], color="tab:blue", label="Pareto front")
    ax.axhline(choice.target_pct, linestyle="--", color="gray", label=f"target {choice.target_pct:g}%")
    if choice.fastest is not None:
        best = runs[choice.fastest]
        ax.scatter(
            [best.dit_s],
            [choice.pcts[choice.fastest]],
            s=200,
            facecolors="none",
            edgecolors="black",
            label="fastest meeting the target",
            zorder=4,
        )
    ax.set_xlabel("median DiT seconds per edit")
    ax.set_ylabel(f"quality: % of the full-quality reference's ({choice.measure.name})")
    ax.set_title("Speed and quality")
    ax.legend(fontsize="small")
    _save(plt, fig, path)
    return True


def _draw(plot, runs: list[RunResult], path: Path, *args) -> bool:
    """Whether ``plot`` drew its chart at ``path``; a chart that cannot be drawn or written (a full disk, a
    folder that refuses it) is one warning line, never the report's failure."""
    try:
        return plot(runs, *args, path) is not False
    except Exception as err:  # noqa: BLE001 - the table and report.md matter more than a picture
        print(f"ditrun: warning: {path} was not drawn ({type(err).__name__}: {err})", file=sys.stderr, flush=True)
        _pyplot().close("all")
        return False


def markdown_report(
    runs: list[RunResult],
    rows,
    baseline: Optional[RunResult],
    has_ssim: bool,
    choice_lines: list[str] = (),
    has_pareto: bool = False,
    has_dit: bool = True,
) -> str:
    parts = ["# ditrun report", "", format_markdown(rows), "", legend(rows[0], RUN_COLUMNS), ""]
    if choice_lines:
        parts += ["## The choice", "", *choice_lines, ""]
        parts += [f"![Speed and quality]({choosing.PARETO_CHART})", ""] if has_pareto else []
    if baseline is not None:
        parts += [
            f"Speedup is relative to `{baseline.label}`. DiT time is the median over the edits after "
            "warm-up; exposed transfer is the time the compute stream waited on the transport.",
            "",
        ]
    parts += [f"![DiT time per edit]({DIT_CHART})", ""] if has_dit else []
    parts += [f"![SSIM per precision]({SSIM_CHART})" if has_ssim else "No run computed SSIM (metrics.ssim=false).", ""]
    parts += ["## Runs", ""]
    for r in runs:
        s = r.summary
        state = r.status if r.complete else f"**{r.status}** ({r.reason})"
        parts.append(
            f"- `{r.label}`: {state}, {len(r.records)} edits, {s.get('device')}, "
            f"{s.get('compute_dtype') or s.get('dtype')}, "
            f"torch {s.get('torch')}, git {s.get('git')}"
            + (f", **failed**: {s['failure']}" if s.get("failure") else "")
        )
    return "\n".join(parts) + "\n"


def _single_run_lines(run: RunResult) -> list[str]:
    """What the report of one run says beside its table: whether its numbers are a whole run's."""
    return [] if run.complete else [f"`{run.label}` is {run.status}: {run.reason}; its numbers are not a verdict."]


def write_report(
    root: Path,
    out_dir: Optional[Path] = None,
    baseline: Optional[str] = None,
    quality: Optional[str] = None,
    target_pct: Optional[float] = None,
    failed: Optional[dict[Path, tuple[list[str], str]]] = None,
) -> tuple[str, Path]:
    """Write ``report.md`` and the charts for the runs under ``root``; returns (text table, report path).

    ``quality`` and ``target_pct`` override the runs' own ``metrics.quality`` and ``metrics.min_ssim_pct``;
    ``failed`` are a sweep's failed jobs (``runs.load_runs``)."""
    runs = load_runs(root, failed)
    choice = choosing.choose(runs, quality, target_pct)
    chosen = choose_baseline(runs, baseline, choice)
    rows = table_rows(runs, chosen, choice)
    out_dir = Path(out_dir) if out_dir else Path(root)
    out_dir.mkdir(parents=True, exist_ok=True)
    files.owned_folder(out_dir)
    has_dit = _draw(plot_dit_time, runs, out_dir / DIT_CHART)
    has_ssim = _draw(plot_ssim, runs, out_dir / SSIM_CHART)
    # One run has nothing to choose from: its own report keeps to its table and charts, and draws its edits.
    choice_lines = choosing.summary_lines(runs, choice) if len(runs) > 1 else _single_run_lines(runs[0])
    has_pareto = len(runs) > 1 and _draw(plot_pareto, runs, out_dir / choosing.PARETO_CHART, choice)
    strip = write_strip(runs[0].path, runs[0].records, out_dir / STRIP_CHART, _pyplot()) if len(runs) == 1 else None
    markdown = markdown_report(runs, rows, chosen, has_ssim, choice_lines, has_pareto, has_dit)
    if strip is not None:
        markdown += f"\n![reference, instruction, output and correct edit of each edit]({STRIP_CHART})\n"
    report = out_dir / REPORT_FILE
    files.write_file(report, markdown.encode())
    text = format_text(rows)
    return "\n".join([text, *(line for line in choice_lines if line), legend(rows[0], RUN_COLUMNS)]), report


REPORT_HELP = """\
Compare the runs of a ditrun run or sweep directory: one row per run (DiT time per edit, speedup, exposed
transfer, quality against the full-quality reference and the correct edit), and of several runs, which keep
the quality target and the fastest of those, with the command that runs it again."""
REPORT_FILES_HELP = f"""\
Writes {REPORT_FILE}, {DIT_CHART}, {SSIM_CHART} (of several runs {choosing.PARETO_CHART}; of one, {STRIP_CHART}) into
DIR or --out, reading only ditrun's own files of each run (summary.json, edits.jsonl, .hydra/overrides.yaml).
A sweep (ditrun -m ...) writes its own report when it ends. Examples:
  ditrun report outputs/<date>/<time>
  ditrun report multirun/<date>/<time> --baseline <run>"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ditrun report",
        usage="ditrun report DIR [--out OUT] [--baseline RUN] [--quality Q] [--target-pct PCT]",
        description=REPORT_HELP,
        epilog=REPORT_FILES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", type=Path, metavar="DIR", help="a ditrun run directory or a multirun (sweep) directory")
    parser.add_argument("--out", type=Path, default=None, help="where report.md and the charts go (default: DIR)")
    parser.add_argument("--baseline", default=None, help="the run the speedup is relative to (its label)")
    parser.add_argument(
        "--quality",
        default=None,
        help="what judges quality: auto, target, rerun or bf16 (default: the runs' metrics.quality)",
    )
    parser.add_argument(
        "--target-pct",
        type=float,
        default=None,
        help="the quality target, percent of the full-quality reference's (default: the runs' "
        f"metrics.min_ssim_pct, else {choosing.DEFAULT_TARGET_PCT:g})",
    )
    args = parser.parse_args(argv)
    try:
        text, report = write_report(args.path, args.out, args.baseline, args.quality, args.target_pct)
    except UserError as err:
        print(f"ditrun: error: {err}", file=sys.stderr)
        return 2
    print(text)
    print(f"report: {report}")
    return 0


FAILED_JOBS: dict[Path, tuple[list[str], str]] = {}
"""The jobs of this process's sweep that failed (directory -> (overrides, why)), noted by the command as each fails
(``note_failed_job``): the sweep's report lists them as incomplete, beside the jobs that finished."""


FAILED_DIR = ".failed_jobs"
"""In a sweep's directory: one file per job that failed (``note_failed_job``), written by the job wherever it ran (a
submitit job runs in a process of its own, on this machine or on a Slurm node), read by the sweep's process at its end
(``collect_failed_jobs``)."""


def note_failed_job(sweep: Path, folder: Path, number: int, overrides: list[str], why: str) -> None:
    """Note a sweep's job that failed (``FAILED_JOBS``, and a file under the sweep's ``FAILED_DIR``) and name it in
    one line."""
    overrides, why = list(overrides), " ".join(why.split())  # one line, whatever the error's text holds
    _noted(Path(folder), number, overrides, why)
    note = {"folder": str(folder), "number": number, "overrides": overrides, "why": why}
    try:
        files.write_json(Path(sweep) / FAILED_DIR / f"{number}.json", note)
    except OSError as err:  # the line above names the job all the same
        print(f"ditrun: warning: job {number}'s failure was not written under {sweep} ({err})", file=sys.stderr)


def _noted(folder: Path, number: int, overrides: list[str], why: str) -> None:
    FAILED_JOBS[folder] = (overrides, why)
    print(f"ditrun: error: job {number} ({' '.join(overrides)}) failed: {why}", file=sys.stderr, flush=True)


def collect_failed_jobs(sweep: Path) -> None:
    """In the sweep's process, at its end: the jobs that failed in processes of their own (their ``FAILED_DIR``
    files), noted and named here too; those that failed in this process are noted already."""
    folder = Path(sweep) / FAILED_DIR
    try:
        names = sorted(os.listdir(folder), key=lambda name: (len(name), name))
    except OSError:
        return  # no job failed elsewhere
    for name in names:
        try:
            note = files.parse_json(files.read_bytes(folder / name, 1 << 20))
        except (OSError, UserError):
            note = None
        fields = {"folder": str, "number": int, "overrides": list, "why": str}
        if not isinstance(note, dict) or not all(isinstance(note.get(k), t) for k, t in fields.items()):
            print(f"ditrun: warning: {folder / name} is not a failed job's note; left out", file=sys.stderr)
            continue
        if Path(note["folder"]) not in FAILED_JOBS:
            _noted(Path(note["folder"]), note["number"], [str(o) for o in note["overrides"]], note["why"])


def forget_failed_jobs(sweep: Path) -> None:
    """The notes of an earlier sweep in the same directory (run again there, its failed jobs may finish now)."""
    folder = Path(sweep) / FAILED_DIR
    if folder.is_symlink() or not folder.is_dir():
        return
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)


class SweepReport(Callback):
    """Hydra callback: when a multirun starts, forget an earlier sweep's failed jobs there; when it ends, write its
    report into the sweep directory."""

    def on_multirun_start(self, config, **kwargs) -> None:
        forget_failed_jobs(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config, **kwargs) -> None:
        collect_failed_jobs(Path(config.hydra.sweep.dir))
        if not config.metrics.report or config.warm.enabled:  # a sweep of ``ditrun warm`` runs no edit
            return
        sweep = Path(config.hydra.sweep.dir)
        try:
            text, report = write_report(sweep, failed=FAILED_JOBS)
        except UserError as err:  # every job failed before writing a summary
            print(f"ditrun: no sweep report: {err}", file=sys.stderr)
            return
        print(text)
        print(f"sweep report: {report}", flush=True)
        log_choice(config, sweep)


def log_choice(config, sweep: Path) -> None:
    """The sweep's choice table as one W&B table in the sweep's group (``wandb.mode`` of the sweep)."""
    from ditrun.metrics import wandb as wandb_log

    runs = load_runs(sweep, FAILED_JOBS)
    choice = choosing.choose(runs)
    try:
        wandb_log.log_sweep_table(config, sweep, "choice", choosing.COLUMNS, choosing.wandb_rows(runs, choice))
    except Exception as err:  # noqa: BLE001 - the report is written; a W&B failure must not fail the sweep
        print(f"ditrun: the sweep's choice table did not reach W&B ({type(err).__name__}: {err}).", file=sys.stderr)
