"""Everything a user can get wrong, checked before anything expensive: on the ranks that will run, before any
process starts (``check_config``), and again by each worker before it builds the model (``check_run_config``).

Every check a user's config can fail (workload, layout, precision, launcher) runs before the model is built, so a
mistake costs seconds, not a 12B-parameter load.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ditrun import cache, metrics
from ditrun.config import take_renamed_keys
from ditrun.devices import DTYPES
from ditrun.errors import UserError
from ditrun.launch import env, faults
from ditrun.model.build import compute_dtype, device_kind, model_geometry
from ditrun.model.compile import plan_compile
from ditrun.model.folders import check_components
from ditrun.model.memory import check_memory
from ditrun.model.precision import plan_precision
from ditrun.parallel.cfg import check_true_cfg
from ditrun.parallel.layout import LayoutPlan, plan_layout
from ditrun.run import compile_cache, warm
from ditrun.transport.registry import check_transport
from ditrun.workload.edit import Edit
from ditrun.workload.inputs import check_inputs, edit_tokens
from ditrun.workload.manifest import check_config as check_workload_config
from ditrun.workload.manifest import resolve_edits, resolve_text_len


def check_config(cfg, world: int) -> LayoutPlan:
    """Everything a user can get wrong, checked on ``world`` ranks before any process starts."""
    take_renamed_keys(cfg)
    # The workload's numbers first: the fault injection's step is checked against workload.steps.
    check_workload_config(cfg.workload)
    check_launcher_config(cfg, world)
    return check_run_config(cfg, world)


def check_launcher_config(cfg, world: int) -> None:
    """Launcher settings a user can get wrong."""
    launcher = cfg.launcher
    if world < 1:
        raise UserError(f"launcher.world={world} must be at least 1.")
    for key in ("rendezvous_timeout_s", "collective_timeout_s", "stop_timeout_s"):
        if not 0 < getattr(launcher, key) < math.inf:
            raise UserError(f"launcher.{key}={getattr(launcher, key)} must be a positive number of seconds.")
    if launcher.master_port is not None and not 1 <= launcher.master_port <= 65535:
        raise UserError(f"launcher.master_port={launcher.master_port} is not a TCP port; allowed: 1 to 65535.")
    faults.check_testing_config(cfg.testing, world, cfg.workload.steps)


def check_run_config(cfg, world: Optional[int] = None) -> LayoutPlan:
    """Config errors that are not type errors, raised before anything expensive; returns the layout plan.

    ``world`` is the number of ranks that will run (default: ``launcher.world``), so a launcher
    can call this before it spawns anything.
    """
    resolve_text_len(cfg)  # the model's when unset: every later check and rank reads the number
    device = device_kind(cfg.device)
    compute_dtype(device, cfg.model.dtype)  # a bad model.dtype fails here, before any rank starts
    plan_precision(cfg.precision, device)
    compile_cache.check_config(cfg.model, plan_compile(cfg.model, device))
    warm.check_config(cfg, device)
    check_transport(cfg.transport)
    check_workload_config(cfg.workload)
    check_true_cfg(cfg.layout.name, cfg.workload.true_cfg_scale)
    metrics.check_config(cfg)
    world = cfg.launcher.world if world is None else world
    geometry = model_geometry(cfg.model)
    check_components(cfg.model.path, cfg.workload.vae_path)
    cache.check_config(cfg.cache, cfg.workload.steps, geometry.num_layers + geometry.num_single_layers)
    check_inputs(resolve_edits(cfg.workload), geometry)
    return plan_layout(cfg.layout, world, geometry.num_attention_heads)


def check_run_memory(edits: list[Edit], cfg, geometry, plan: LayoutPlan, device_dtype) -> None:
    """``model.memory.check_memory`` with this run's inputs: the edits' token counts, the widest dtype the model is
    built in (its own, or the SSIM references'), and the ranks that share this machine."""
    dtypes = [device_dtype.dtype]
    if cfg.metrics.ssim and cfg.metrics.full_quality_dtype:
        dtypes.append(DTYPES[cfg.metrics.full_quality_dtype])
    element = max(torch.empty(0, dtype=d).element_size() for d in dtypes)
    info = env.discover()
    tokens = {edit.id: edit_tokens(edit, cfg.workload.text_len) for edit in edits}
    check_memory(edits, tokens, element, geometry, plan, device_dtype, info.local_world if info is not None else 1)
