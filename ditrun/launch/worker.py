"""One worker: build the model once, then run this replica's share of the edits.

The order matters: every check a user's config can fail (workload, layout, precision) runs
before the model is built, so a mistake costs seconds, not a 12B-parameter load.
"""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import save_file

from ditrun.launch import faults, rendezvous
from ditrun import metrics
from ditrun.metrics import quality, reference, results, timing
from ditrun.metrics import wandb as wandb_log
from ditrun.metrics.progress import Progress
from ditrun.metrics.timing import ExposedTransfer, Interval, StepTimer, peak_memory_bytes, reset_peak_memory
from ditrun.model.build import (build_model, compute_dtype, device_kind, inexact_repack_rows, model_geometry,
                                 plan_precision, precision_label, select_placement)
from ditrun.model.latents import VAE_SCALE, make_latent_codec, unpack
from ditrun.model.sampler import denoise
from ditrun.parallel.cfg import layout_velocity
from ditrun.parallel.layout import LayoutPlan, build_layout, plan_layout
from ditrun.transport.base import make_transport
from ditrun.workload import Edit, check_sources, edit_inputs, resolve_edits
from ditrun.errors import UserError

IMPLEMENTED_TRANSPORTS = ("collective",)


def check_config(cfg, world: Optional[int] = None) -> LayoutPlan:
    """Config errors that are not type errors, raised before anything expensive; returns the layout plan.

    ``world`` is the number of ranks that will run (default: ``launcher.world``), so a launcher
    can call this before it spawns anything.
    """
    device = device_kind(cfg.device)
    compute_dtype(device, cfg.model.dtype)  # a bad model.dtype fails here, before any rank starts
    plan_precision(cfg.precision, device)
    if cfg.transport.name not in IMPLEMENTED_TRANSPORTS:
        raise UserError(
            f"transport={cfg.transport.name!r} is not available; allowed: {', '.join(IMPLEMENTED_TRANSPORTS)}."
        )
    if cfg.workload.steps < 1:
        raise UserError(f"workload.steps={cfg.workload.steps} must be at least 1.")
    metrics.check_config(cfg)
    world = cfg.launcher.world if world is None else world
    return plan_layout(cfg.layout, world, model_geometry(cfg.model).num_attention_heads)


def git_revision() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
            text=True, timeout=5,
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


class Run:
    """State of one worker's run: placement, layout, model, codec and output directory."""

    def __init__(self, cfg, out_dir: Path):
        self.cfg = cfg
        self.out_dir = out_dir
        # Under a launcher the process group is the truth; alone, launcher.world must say 1.
        plan = check_config(cfg, dist.get_world_size() if dist.is_initialized() else None)
        self.edits = resolve_edits(cfg.workload)
        check_sources(self.edits)
        self.geometry = model_geometry(cfg.model)
        self.placement = select_placement(cfg.device, cfg.model.dtype)
        self.layout = build_layout(plan, timedelta(seconds=cfg.launcher.collective_timeout_s))
        # References first: their model is freed before the measured one is built.
        self.references = self._references() if cfg.metrics.ssim else None
        reset_peak_memory(self.placement.device)
        # A transport times every wait of the compute stream here; ``single`` has none, so 0.
        self.exposed = ExposedTransfer(self.placement.device)
        self.transports = {axis: make_transport(cfg.transport.name, self.layout.groups[axis], self.exposed)
                           for axis in ("sp", "cfg")}
        self.precision = plan_precision(cfg.precision, self.placement.device)
        self.built = build_model(cfg.model, self.placement, self.precision, announce=self.layout.rank == 0)
        self.model = self.built.model
        self.precision_label = precision_label(self.precision, self.placement.dtype_name)
        self.codec = make_latent_codec(cfg.workload.vae_path, self.placement.device, self.placement.dtype)

    def _references(self) -> reference.References:
        """Each replica's writer makes the missing references of its edits; every rank then waits for
        them on the control group (no timeout that a long reference pass could trip)."""
        cfg, placement = self.cfg, self.placement
        dtype = reference.REFERENCE_DTYPES[cfg.metrics.reference_dtype] if cfg.metrics.reference_dtype \
            else placement.dtype
        references = reference.reference_set(cfg, self.geometry, self.edits, dtype, placement.device.type)
        if self.layout.writes_records:
            share = self.layout.edit_share(self.edits)
            rank0 = self.layout.rank == 0
            with Progress(cfg.progress and rank0, len(share), desc="references") as progress:
                references.make_missing(share, cfg, self.geometry, placement.device,
                                        lambda d: build_model(cfg.model, dataclasses.replace(placement, dtype=d)).model,
                                        progress, announce=rank0)
        self.layout.barrier()
        return references

    def run_edit(self, edit: Edit, progress=None) -> Optional[dict]:
        """Run one edit on this rank; the rank that writes its replica's results gets the record."""
        cfg, placement = self.cfg, self.placement
        with Interval(placement.device) as encode:
            inputs = edit_inputs(edit, self.codec, self.geometry, cfg.workload.text_len, placement.device)
        guidance = cfg.workload.distilled_guidance if self.geometry.guidance_embeds else None
        velocity = layout_velocity(
            self.layout, self.transports, self.model, inputs, cfg.workload.guidance_scale, guidance, placement.dtype,
            inner_attention=self.built.attention,
        )
        timer = StepTimer(placement.device)
        self.exposed.take()  # start the edit's count from zero

        def on_step(i: int) -> None:
            timer.step(i)
            faults.inject(cfg.launcher.fault, i)
            if progress is not None:
                progress.update(1)

        timer.start()
        with torch.inference_mode():
            latents = denoise(velocity, inputs.noise, cfg.workload.steps, on_step=on_step)
        step_s = timer.step_seconds()
        exposed = self.exposed.take()
        if not self.layout.writes_records:
            return None
        h, w = edit.height // VAE_SCALE, edit.width // VAE_SCALE
        with Interval(placement.device) as decode:
            image = results.to_rgb8(self.codec.decode(unpack(latents, h, w)))
        png = f"{edit.id}.png"
        results.save_png(image, self.out_dir / png)
        save_file({"latents": latents.cpu().contiguous()}, str(self.out_dir / f"{edit.id}.latents.safetensors"))
        ref = self.references.get(edit.id) if self.references is not None else None
        return self._record(edit, step_s, exposed, png, {
            **quality.quality_fields(image, ref), "encode_s": encode.seconds, "decode_s": decode.seconds})

    def _record(self, edit: Edit, step_s: list[float], exposed: dict, png: str,
                measured: Optional[dict] = None) -> dict:
        """One line of edits.jsonl: DESIGN.md's fields in its order, then the extras."""
        cfg, plan, measured = self.cfg, self.layout.plan, dict(measured or {})
        quality_fields = {key: measured.pop(key, None) for key in quality.QUALITY_FIELDS}
        return {
            "edit": edit.id, "seed": edit.seed, "width": edit.width, "height": edit.height,
            "steps": cfg.workload.steps, "layout": plan.name, "precision": self.precision_label,
            "transport": cfg.transport.name, "world": plan.world,
            **timing.edit_timing(step_s, exposed, cfg.metrics.transfer_breakdown),
            **quality_fields, "image": png, "replica": self.layout.replica, "head_groups": plan.head_groups,
            "latents": f"{edit.id}.latents.safetensors", "precision_map": self.precision.formats(), **measured,
        }

    def summary(self, records: list[dict], wall_s: float) -> dict:
        return {
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "edits": len(records),
            "world": self.layout.plan.world,
            **timing.timing_summary(records, self.cfg.metrics.warmup_edits, self.layout.plan.replicas),
            **quality.quality_summary(records),
            "wall_s": wall_s,
            "peak_memory_bytes": peak_memory_bytes(self.placement.device),
            "device": device_name(self.placement.device),
            "dtype": self.placement.dtype_note,
            "precision": self.precision_label,
            "precision_detail": self.built.details,
            "mx_repack_inexact_rows": inexact_repack_rows(self.model),
            "torch": torch.__version__,
            "git": git_revision(),
        }


def run(cfg, out_dir: Path) -> Optional[dict]:
    """Run this rank's part of the workload; returns the summary on global rank 0, None elsewhere.

    Edits are shared out over the replicas before the records of a resumed run are read, so
    every rank of a replica agrees on its edits without talking; only the replica's records
    are ever appended by its own writer, after all its ranks have started. Global rank 0 alone
    logs to W&B, writes the summary and the report, and applies the SSIM gate.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    state = Run(cfg, out_dir)
    layout = state.layout
    done = results.finished_edits(out_dir)
    if layout.rank == 0:
        _print_start(state, out_dir, len(done))
    logger = wandb_log.start(cfg, out_dir, layout.rank == 0)  # its start-up stays out of every timed region
    todo = [edit for edit in layout.edit_share(state.edits) if edit.id not in done]
    with Progress(cfg.progress and layout.rank == 0, len(todo)) as progress:
        for edit in todo:
            bar = progress.edit(edit.id, cfg.workload.steps)
            record = state.run_edit(edit, bar)
            bar.close()
            if record is not None:
                results.append_record(out_dir, record)
                logger.log_edit(record)
            progress.advance()
    layout.barrier()  # every replica's records are in edits.jsonl
    if layout.rank != 0:
        return None
    return _finish(state, logger, out_dir, time.perf_counter() - start)


def _finish(state: Run, logger, out_dir: Path, wall_s: float) -> dict:
    """Global rank 0: summary.json, the W&B run's table and summary, the report; then the SSIM gate."""
    cfg = state.cfg
    done = results.finished_edits(out_dir)
    records = [done[e.id] for e in state.edits if e.id in done]
    summary = state.summary(records, wall_s)
    summary.update(wandb=str(logger.location) if logger.location else None, wandb_init_s=logger.init_s,
                   failure=quality.gate_failure(summary, cfg.metrics.min_ssim_pct))
    results.write_json(out_dir / results.SUMMARY_FILE, summary)
    logger.finish(records, summary, out_dir, state.references, failed=summary["failure"] is not None)
    report_file = _write_report(out_dir) if cfg.metrics.report else None
    print_table(records, summary)
    print_locations(cfg, summary, out_dir, report_file)
    if summary["failure"]:
        raise quality.QualityGateError(summary["failure"])
    return summary


def _print_start(state: Run, out_dir: Path, n_done: int) -> None:
    plan = state.layout.plan
    print(f"ditrun: {len(state.edits)} edits on {device_name(state.placement.device)}, "
          f"{state.placement.dtype_note}, precision {state.precision_label}, layout {plan.name} "
          f"({plan.replicas} replica(s) x {plan.workers} worker(s)), results in {out_dir}", flush=True)
    if n_done:
        print(f"ditrun: resuming, {n_done} edits already in {results.EDITS_FILE} are skipped", flush=True)


def _write_report(out_dir: Path) -> Path:
    from ditrun.metrics.report import write_report

    return write_report(out_dir)[1]


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(records: list[dict], summary: dict) -> None:
    rows = [("edit", "size", "steps", "DiT s", "s/step", "exposed %", "SSIM", "% of rerun", "image")]
    for r in records:
        rows.append((r["edit"], f"{r['width']}x{r['height']}", str(r["steps"]), f"{r['dit_s']:.3f}",
                     f"{r['dit_s'] / max(r['steps'], 1):.3f}", f"{r['exposed_transfer_pct']:.1f}",
                     _cell(r.get("ssim"), ".4f"), _cell(r.get("ssim_pct_of_rerun"), ".2f"), r["image"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"median DiT s/edit (after warm-up): {_cell(summary['dit_s_median'], '.3f')}   "
          f"images/s: {summary['images_per_s']:.3f}   "
          f"exposed transfer: {_cell(summary['exposed_transfer_pct_median'], '.1f')}%   "
          f"SSIM: {_cell(summary['ssim_median'], '.4f')} ({_cell(summary['ssim_pct_of_rerun_median'], '.2f')}% of rerun)   "
          f"device: {summary['device']} ({summary['dtype']})")


def print_locations(cfg, summary: dict, out_dir: Path, report_file: Optional[Path]) -> None:
    if summary.get("wandb"):
        sync = f"   (upload later: wandb sync {summary['wandb']})" if cfg.wandb.mode == "offline" else ""
        print(f"W&B {cfg.wandb.mode} run: {summary['wandb']}{sync}")
    if report_file is not None:
        print(f"report: {report_file}   (compare runs: ditrun report <run or multirun dir>)")
    if summary.get("failure"):
        print(f"FAILED: {summary['failure']}")
    print(f"results: {out_dir}", flush=True)
