"""What a run writes about itself: the settings an edit's result depends on (its fingerprint), one line of
``edits.jsonl`` per edit, and ``summary.json``'s fields, built from a worker's ``Run``."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from ditrun.devices import device_name, dtype_name
from ditrun.launch.stop import RunStopped
from ditrun.metrics import full_quality, quality, timing
from ditrun.metrics import full_quality_images as reference
from ditrun.model.build import inexact_repack_rows
from ditrun.results import files, rundir
from ditrun.timers import peak_memory_bytes
from ditrun.workload.edit import Edit
from ditrun.workload.images import is_package_picture
from ditrun.workload.manifest import declared_edits


def git_revision(where: Path = Path(__file__).parent) -> str:
    """The commit of the checkout holding ``where`` (ditrun's own, by default), with "+modified" where tracked files
    differ from it (the code that ran is not the commit's), or "unknown" outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=5).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        modified = commit and git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("+modified" if modified else "")) or "unknown"


def _source(image: str) -> str:
    """An edit's picture as its record names it: a package's picture by its name (``skimage:<name>`` ...), or the
    file's absolute path."""
    return image if is_package_picture(image) else str(Path(image).resolve())


def result_settings(run, edit: Edit) -> dict:
    """Everything that changes this edit's result (not the layout, transport or world size)."""
    _, described = reference.reference_key(
        run.cfg, run.geometry, edit, run.device_dtype.dtype, run.device_dtype.device.type
    )
    described.pop("format")
    # The key's sampling settings are the reference's; the edit's own are the run's, and its scores are against
    # that reference. The backend is left out, like the layout: fast kernels match the exact emulation.
    settings = {
        **described,
        **reference.sampling(run.cfg.workload),
        "reference": reference.sampling(full_quality.full_quality_workload(run.cfg)),
        "precision": {**run.precision.formats(), "scale_mode": run.precision.scale_mode},
    }
    if run.cfg.cache.name != "none":  # absent without a cache: an uncached edit names no cache keys
        settings["cache"] = OmegaConf.to_container(run.cfg.cache, resolve=True)
    return settings


def run_settings(run) -> dict:
    """What every run of the results directory must share (``rundir.run_settings``)."""
    described = run.settings[run.edits[0].id]
    resolved = {"device": described["device"], "model.dtype": described["dtype"], "workload.vae": described["vae"]}
    if run.cfg.model.path:  # the weights' files (seeded weights are model.weights_seed)
        resolved["model.weights"] = described["weights"]
    config = OmegaConf.to_container(run.cfg, resolve=True)
    if run.cfg.cache.name == "none":  # a run that caches nothing: no other cache key changes it (as per edit)
        config["cache"] = {"name": "none"}
    return rundir.run_settings(config, resolved, declared_edits(run.cfg.workload))


def edit_record(
    run, edit: Edit, step_s: list[float], exposed: dict, sha256: dict[str, str], measured: Optional[dict] = None
) -> dict:
    """One line of edits.jsonl: the fields docs/METRICS.md lists, in its order, then the extras."""
    cfg, plan, measured = run.cfg, run.layout.plan, dict(measured or {})
    quality_fields = {key: measured.pop(key, None) for key in quality.QUALITY_FIELDS}
    outputs = files.edit_outputs(edit.id)
    return {
        "edit": edit.id,
        "seed": edit.seed,
        "width": edit.width,
        "height": edit.height,
        "steps": cfg.workload.steps,
        "layout": plan.name,
        "precision": run.precision_label,
        "transport": cfg.transport.name,
        "world": plan.world,
        **timing.edit_timing(step_s, exposed, cfg.metrics.transfer_breakdown),
        **quality_fields,
        "image": outputs["image"],
        "replica": run.layout.replica,
        "session": run.session,
        "head_groups": plan.head_groups,
        "latents": outputs["latents"],
        "sha256": sha256,
        "precision_map": run.precision.formats(),
        "reference": _source(edit.image),
        "target": edit.target,
        **measured,
        "fingerprint": rundir.fingerprint(run.settings[edit.id]),
        "settings": run.settings[edit.id],
    }


def run_summary(
    run, records: list[dict], wall_s: float, stopped: Optional[RunStopped] = None, startup: Optional[list[dict]] = None
) -> dict:
    """summary.json's fields (``stopped``: the stop that ended the run early, if any)."""
    scores = quality.quality_summary(records)
    return {
        "config": OmegaConf.to_container(run.cfg, resolve=True),
        "run_id": run.run_id,
        "edits": len(records),
        "complete": len(records) == len(run.directory_edits),
        "stopped": str(stopped) if stopped else None,
        "world": run.layout.plan.world,
        **timing.timing_summary(records, run.cfg.metrics.warmup_edits, run.layout.plan.replicas),
        **scores,
        "reference": reference.sampling(full_quality.full_quality_workload(run.cfg)),
        "quality_measure": quality.measure_name(run.cfg.metrics.quality, [scores]),
        **timing.cache_summary(records),
        "wall_s": wall_s,
        **timing.startup_summary(startup or []),
        "compile_cache": run.compile_cache.fields() if run.compile_cache is not None else None,
        "peak_memory_bytes": peak_memory_bytes(run.device_dtype.device),
        "device": device_name(run.device_dtype.device),
        "dtype": run.device_dtype.dtype_note,
        "compute_dtype": run.device_dtype.dtype_name,
        # What the full-quality reference ran in: BF16 on GPUs, the CPU's fp32 unless metrics.full_quality_dtype says.
        "reference_dtype": dtype_name(run.references.dtype) if run.references is not None else None,
        "precision": run.precision_label,
        "precision_detail": run.built.details if run.built is not None else None,
        "mx_repack_inexact_rows": inexact_repack_rows(run.model) if run.built is not None else 0,
        "torch": torch.__version__,
        "git": git_revision(),
    }
