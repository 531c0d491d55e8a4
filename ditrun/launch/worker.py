"""One worker: build the model once, then run this replica's share of the edits.

The order matters: every check a user's config can fail (workload, layout, precision) runs
before the model is built, so a mistake costs seconds, not a 12B-parameter load.
"""

from __future__ import annotations

import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import save_file

from ditrun.metrics import results
from ditrun.metrics.timing import ExposedTransfer, StepTimer, peak_memory_bytes
from ditrun.model.dit import FluxDiT
from ditrun.model.latents import VAE_SCALE, make_latent_codec, unpack
from ditrun.model.load import checkpoint_geometry, from_pretrained, random_model
from ditrun.model.presets import geometry_from_config
from ditrun.model.sampler import denoise
from ditrun.parallel.cfg import layout_velocity
from ditrun.parallel.layout import LayoutPlan, build_layout, plan_layout
from ditrun.transport.base import make_transport
from ditrun.workload import Edit, check_sources, edit_inputs, resolve_edits

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLEMENTED_FORMATS = ("bf16",)
IMPLEMENTED_TRANSPORTS = ("collective",)


@dataclass
class Placement:
    """Where this worker runs and in which dtype, with the reason for the dtype."""

    device: torch.device
    dtype: torch.dtype
    dtype_note: str


def select_placement(device_key: str, dtype_key: str) -> Placement:
    if device_key not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device={device_key!r} is unknown; allowed: auto, cuda, cpu.")
    if device_key == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA/ROCm GPU is visible to PyTorch; use device=auto or cpu.")
    use_gpu = device_key == "cuda" or (device_key == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    if dtype_key not in ("auto", *DTYPES):
        raise ValueError(f"model.dtype={dtype_key!r} is unknown; allowed: auto, {', '.join(DTYPES)}.")
    if dtype_key != "auto":
        return Placement(device, DTYPES[dtype_key], f"{dtype_key} (model.dtype)")
    if use_gpu:
        return Placement(device, torch.bfloat16, "bf16")
    return Placement(device, torch.float32, "fp32 (bf16 is slow on CPUs; set model.dtype=bf16 to force it)")


def check_config(cfg, world: Optional[int] = None) -> LayoutPlan:
    """Config errors that are not type errors, raised before anything expensive; returns the layout plan.

    ``world`` is the number of ranks that will run (default: ``launcher.world``), so a launcher
    can call this before it spawns anything.
    """
    for component in ("mlp", "qkv", "out", "attention"):
        value = getattr(cfg.precision, component)
        if value not in IMPLEMENTED_FORMATS:
            raise ValueError(
                f"precision.{component}={value!r} is not available; allowed: {', '.join(IMPLEMENTED_FORMATS)}."
            )
    if cfg.transport.name not in IMPLEMENTED_TRANSPORTS:
        raise ValueError(
            f"transport={cfg.transport.name!r} is not available; allowed: {', '.join(IMPLEMENTED_TRANSPORTS)}."
        )
    if cfg.workload.steps < 1:
        raise ValueError(f"workload.steps={cfg.workload.steps} must be at least 1.")
    world = cfg.launcher.world if world is None else world
    return plan_layout(cfg.layout, world, model_geometry(cfg.model).num_attention_heads)


def build_model(model_cfg, placement: Placement) -> FluxDiT:
    """Load the weights at ``model.path``, or draw seeded random weights of the preset."""
    if model_cfg.path:
        return from_pretrained(model_cfg.path, dtype=placement.dtype, device=placement.device)
    geometry = geometry_from_config(model_cfg)
    return random_model(geometry, seed=model_cfg.weights_seed, dtype=placement.dtype, device=placement.device)


def model_geometry(model_cfg):
    """The geometry without building the model (for early checks)."""
    if model_cfg.path:
        return checkpoint_geometry(model_cfg.path)
    return geometry_from_config(model_cfg)


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
        self.layout = build_layout(plan)
        self.exposed = ExposedTransfer(self.placement.device)
        self.transports = {axis: make_transport(cfg.transport.name, self.layout.groups[axis], self.exposed)
                           for axis in ("sp", "cfg")}
        self.model = build_model(cfg.model, self.placement)
        self.codec = make_latent_codec(cfg.workload.vae_path, self.placement.device, self.placement.dtype)

    def run_edit(self, edit: Edit, progress=None) -> Optional[dict]:
        """Run one edit on this rank; the rank that writes its replica's results gets the record."""
        cfg, placement = self.cfg, self.placement
        inputs = edit_inputs(edit, self.codec, self.geometry, cfg.workload.text_len, placement.device)
        guidance = cfg.workload.distilled_guidance if self.geometry.guidance_embeds else None
        velocity = layout_velocity(
            self.layout, self.transports, self.model, inputs, cfg.workload.guidance_scale, guidance, placement.dtype
        )
        timer = StepTimer(placement.device)
        self.exposed.take()  # start the edit's count from zero

        def on_step(i: int) -> None:
            timer.step(i)
            if progress is not None:
                progress.update(1)

        timer.start()
        with torch.inference_mode():
            latents = denoise(velocity, inputs.noise, cfg.workload.steps, on_step=on_step)
        step_s = timer.step_seconds()
        exposed_s = self.exposed.take()["total_s"]
        if not self.layout.writes_records:
            return None
        h, w = edit.height // VAE_SCALE, edit.width // VAE_SCALE
        image = self.codec.decode(unpack(latents, h, w))
        png = f"{edit.id}.png"
        results.save_png(image, self.out_dir / png)
        save_file({"latents": latents.cpu().contiguous()}, str(self.out_dir / f"{edit.id}.latents.safetensors"))
        return self._record(edit, step_s, exposed_s, png)

    def _record(self, edit: Edit, step_s: list[float], exposed_s: float, png: str) -> dict:
        cfg, plan = self.cfg, self.layout.plan
        dit_s = sum(step_s)
        return {
            "edit": edit.id, "seed": edit.seed, "width": edit.width, "height": edit.height,
            "steps": cfg.workload.steps, "layout": plan.name, "precision": cfg.precision.name,
            "transport": cfg.transport.name, "world": plan.world, "replica": self.layout.replica,
            "head_groups": plan.head_groups, "dit_s": dit_s, "step_s": step_s,
            "exposed_transfer_s": exposed_s, "exposed_transfer_pct": 100.0 * exposed_s / dit_s if dit_s > 0 else 0.0,
            "image": png, "latents": f"{edit.id}.latents.safetensors",
        }

    def summary(self, records: list[dict], wall_s: float) -> dict:
        warmup = self.cfg.metrics.warmup_edits
        dit = [r["dit_s"] for r in records]
        median = results.median_after_warmup(dit, warmup)
        return {
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "edits": len(records),
            "world": self.layout.plan.world,
            "dit_s_median": median,
            "images_per_s": (self.layout.plan.replicas / median) if median > 0 else float("nan"),
            "exposed_transfer_pct_median": results.median_after_warmup(
                [r["exposed_transfer_pct"] for r in records], warmup),
            "wall_s": wall_s,
            "peak_memory_bytes": peak_memory_bytes(self.placement.device),
            "device": device_name(self.placement.device),
            "dtype": self.placement.dtype_note,
            "torch": torch.__version__,
            "git": git_revision(),
        }


def run(cfg, out_dir: Path) -> Optional[dict]:
    """Run this rank's part of the workload; returns the summary on global rank 0, None elsewhere.

    Edits are shared out over the replicas before the records of a resumed run are read, so
    every rank of a replica agrees on its edits without talking; only the replica's records
    are ever appended by its own writer, after all its ranks have started.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    state = Run(cfg, out_dir)
    layout = state.layout
    done = results.finished_edits(out_dir)
    if layout.rank == 0:
        _print_start(state, out_dir, len(done))
    for edit in layout.edit_share(state.edits):
        if edit.id in done:
            continue
        with _progress(cfg, edit, layout.rank) as bar:
            record = state.run_edit(edit, bar)
        if record is not None:
            results.append_record(out_dir, record)
    layout.barrier()  # every replica's records are in edits.jsonl
    if layout.rank != 0:
        return None
    done = results.finished_edits(out_dir)
    records = [done[e.id] for e in state.edits if e.id in done]
    summary = state.summary(records, time.perf_counter() - start)
    results.write_json(out_dir / results.SUMMARY_FILE, summary)
    print_table(records, summary)
    return summary


def _print_start(state: Run, out_dir: Path, n_done: int) -> None:
    plan = state.layout.plan
    print(f"ditrun: {len(state.edits)} edits on {device_name(state.placement.device)}, "
          f"{state.placement.dtype_note}, layout {plan.name} ({plan.replicas} replica(s) x {plan.workers} "
          f"worker(s)), results in {out_dir}", flush=True)
    if n_done:
        print(f"ditrun: resuming, {n_done} edits already in {results.EDITS_FILE} are skipped", flush=True)


def _progress(cfg, edit: Edit, rank: int):
    from tqdm import tqdm
    import sys

    disable = rank != 0 or not (cfg.progress and sys.stderr.isatty())
    return tqdm(total=cfg.workload.steps, desc=edit.id, unit="step", leave=False, disable=disable)


def print_table(records: list[dict], summary: dict) -> None:
    rows = [("edit", "size", "steps", "DiT s", "s/step", "exposed %", "image")]
    for r in records:
        rows.append((r["edit"], f"{r['width']}x{r['height']}", str(r["steps"]), f"{r['dit_s']:.3f}",
                     f"{r['dit_s'] / max(r['steps'], 1):.3f}", f"{r['exposed_transfer_pct']:.1f}", r["image"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    print(f"median DiT s/edit (after warm-up): {summary['dit_s_median']:.3f}   "
          f"images/s: {summary['images_per_s']:.3f}   device: {summary['device']} ({summary['dtype']})")
