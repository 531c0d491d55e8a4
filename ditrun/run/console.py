"""What global rank 0 prints: the run's start, each edit's row (laid out as ``ditrun report``'s table) with the
medians under them, and where the results went."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ditrun.devices import device_name
from ditrun.metrics import columns
from ditrun.metrics import target as targets
from ditrun.metrics.report import format_text
from ditrun.results import files


def print_start(state, out_dir: Path, n_done: int) -> None:
    plan = state.layout.plan
    print(
        f"ditrun: {len(state.edits)} edits on {device_name(state.device_dtype.device)}, "
        f"{state.device_dtype.dtype_note}, precision {state.precision_label}, layout {plan.name} "
        f"({plan.replicas} replica(s) x {plan.workers} worker(s)), results in {out_dir}",
        flush=True,
    )
    if n_done:
        print(f"ditrun: resuming, {n_done} edits already in {files.EDITS_FILE} are skipped", flush=True)


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _margin_cell(record: dict) -> str:
    return "= input" if record.get("target_equals_input") else _cell(record.get("margin_db"), "+.2f")


def print_table(records: list[dict], summary: dict) -> None:
    """The run's edits, one row each; the headline quality is against the correct edit (PSNR, its margin over
    doing nothing and every wrong edit, the colour error), beside SSIM against the full-quality reference and the
    reference's own PSNR (its column named by the dtype it ran in). Every column is explained under the table."""
    reference_dtype = summary.get("reference_dtype")
    header = (
        "edit",
        "size",
        "steps",
        "DiT s",
        "s/step",
        "exposed %",
        "SSIM",
        "% of rerun",
        "PSNR target",
        "margin dB",
        "dE00",
        columns.reference_column(reference_dtype),
        "image",
    )
    rows = [header]
    for r in records:
        steps = f"{r['steps_computed']}/{r['steps']}" if r.get("steps_cached") else str(r["steps"])  # computed/all
        rows.append(
            (
                r["edit"],
                f"{r['width']}x{r['height']}",
                steps,
                f"{r['dit_s']:.3f}",
                f"{r['dit_s'] / max(r['steps'], 1):.3f}",
                f"{r['exposed_transfer_pct']:.1f}",
                _cell(r.get("ssim"), ".4f"),
                _cell(r.get("ssim_pct_of_rerun"), ".2f"),
                _cell(r.get("psnr_target"), ".2f"),
                _margin_cell(r),
                _cell(r.get("delta_e_target"), ".1f"),
                _cell(r.get("psnr_target_bf16"), ".2f"),
                r["image"],
            )
        )
    print(format_text(rows))
    print(
        f"median DiT s/edit (after warm-up): {_cell(summary['dit_s_median'], '.3f')}   "
        f"images/s: {summary['images_per_s']:.3f}   "
        f"exposed transfer: {_cell(summary['exposed_transfer_pct_median'], '.1f')}%   "
        f"SSIM: {_cell(summary['ssim_median'], '.4f')} "
        f"({_cell(summary['ssim_pct_of_rerun_median'], '.2f')}% of rerun)   "
        f"device: {summary['device']}, {summary.get('compute_dtype') or summary['dtype']}"
    )
    if summary.get("edits_right_share") is not None:
        print(targets.describe(summary))
    print(columns.legend(header, columns.EDIT_COLUMNS, reference_dtype))


def print_locations(cfg, summary: dict, out_dir: Path, report_file: Optional[Path]) -> None:
    if summary.get("wandb"):
        sync = f"   (upload later: wandb sync {summary['wandb']})" if cfg.wandb.mode == "offline" else ""
        print(f"W&B {cfg.wandb.mode} run: {summary['wandb']}{sync}")
    if report_file is not None:
        print(f"report: {report_file}   (compare runs: ditrun report <run or multirun dir>)")
    if summary.get("failure"):
        print(f"FAILED: {summary['failure']}")
    print(f"results: {out_dir}", flush=True)
