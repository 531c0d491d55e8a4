"""Building the model a run measures, in one path that reads top to bottom:

geometry -> module on ``meta`` (no memory) -> weights (read or drawn straight onto the device in
the compute dtype) -> quantized per the precision map (weights converted once) -> placed (eval,
no grad). Weights go to the device before quantizing because quantizing a 12B model is a GPU
job; quantizing only shrinks what is already there, so nothing is held twice at full size.

Every precision check a config can fail runs in ``precision.plan_precision``, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ditrun.devices import DTYPES, dtype_name
from ditrun.errors import UserError
from ditrun.kernels.attention import (
    ATTENTION_KERNELS,
    EMULATION,
    choose_implementation,
    fast_attention_available,
)
from ditrun.kernels.attention_payload import Payload, payload_for
from ditrun.kernels.linear import QuantizedLinear
from ditrun.kernels.sdpa import AttentionFn
from ditrun.kernels.tuning import DispatchTable
from ditrun.model.compile import CompilePlan, apply_plan
from ditrun.model.dit import DiTGeometry, FluxDiT
from ditrun.model.folders import transformer_folder
from ditrun.model.graphs import GraphedForward
from ditrun.model.load import checkpoint_geometry, draw_random_weights, load_pretrained_weights
from ditrun.model.precision import PrecisionPlan, plan_precision, precision_label
from ditrun.model.presets import check_preset_name, geometry_from_config
from ditrun.model.quantize import quantize_model


@dataclass
class DeviceDtype:
    """Where this worker runs and in which dtype, with the reason for the dtype."""

    device: torch.device
    dtype: torch.dtype
    dtype_note: str

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)


def device_kind(device_key: str) -> torch.device:
    """``cuda`` or ``cpu`` as ``device=`` decides, without initialising CUDA (launchers check configs
    before they spawn ranks, and a CUDA context there would hold GPU memory for the whole run)."""
    if device_key not in ("auto", "cuda", "cpu"):
        raise UserError(f"device={device_key!r} is unknown; allowed: auto, cuda, cpu.")
    if device_key == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA/ROCm GPU is visible to PyTorch; use device=auto or cpu.")
    # ``torch.cuda.is_available`` asks the driver without creating a context.
    return torch.device("cuda" if device_key == "cuda" or torch.cuda.is_available() and device_key == "auto" else "cpu")


def compute_dtype(device: torch.device, dtype_key: str) -> tuple[torch.dtype, str]:
    """The compute dtype and the note that says why."""
    if dtype_key not in ("auto", *DTYPES):
        raise UserError(f"model.dtype={dtype_key!r} is unknown; allowed: auto, {', '.join(DTYPES)}.")
    if dtype_key != "auto":
        return DTYPES[dtype_key], f"{dtype_key} (model.dtype)"
    if device.type == "cuda":
        return torch.bfloat16, "bf16"
    return torch.float32, "fp32 (bf16 is slow on CPUs; set model.dtype=bf16 to force it)"


def select_device_dtype(device_key: str, dtype_key: str) -> DeviceDtype:
    device = device_kind(device_key)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return DeviceDtype(device, *compute_dtype(device, dtype_key))


def model_geometry(model_cfg) -> DiTGeometry:
    """The geometry without building the model (for early checks). A folder's ``config.json`` gives it, but
    the preset's name is checked all the same: a mistyped preset is a mistake whatever path is set."""
    if model_cfg.path:
        check_preset_name(model_cfg.preset)
        return checkpoint_geometry(transformer_folder(model_cfg.path))
    return geometry_from_config(model_cfg)


# ---------------------------------------------------------------------------------------------
# What a run's precision is called


def run_precision_label(cfg) -> str:
    """``precision_label`` of a whole run config (for names chosen before any worker starts)."""
    device = device_kind(cfg.device)
    return precision_label(plan_precision(cfg.precision, device), dtype_name(compute_dtype(device, cfg.model.dtype)[0]))


# ---------------------------------------------------------------------------------------------
# The build path


@dataclass
class ModelParts:
    """The forward in the parts a step cache calls (``FluxDiT.head``, ``tail``, ``finish``; ``ditrun/cache``),
    replayed from CUDA graphs where the whole forward is."""

    head: Callable
    tail: Callable
    finish: Callable


@dataclass
class BuiltModel:
    """The model and what was decided while building it, for records and reports."""

    model: FluxDiT
    attention: AttentionFn
    precision: Optional[PrecisionPlan] = None
    details: dict = field(default_factory=dict)
    """Per component: the format and the backends its weights were prepared for; the attention kernel."""
    forward: Optional[Callable] = None
    """What a layout calls: the model, or its forward replayed from CUDA graphs (``model.cuda_graphs``)."""
    parts: Optional[ModelParts] = None
    """The same, in the parts a step cache calls."""
    payload: Optional[Payload] = None
    """What a sequence-parallel exchange carries of Q, K and V: this attention's codes (``attention_payload.py``),
    or None: the values, in the model dtype."""

    def __post_init__(self):
        self.forward = self.model if self.forward is None else self.forward
        self.parts = self.parts or ModelParts(self.model.head, self.model.tail, self.model.finish)


def build_model(
    model_cfg,
    device_dtype: DeviceDtype,
    precision: Optional[PrecisionPlan] = None,
    announce: bool = True,
    table: Optional[DispatchTable] = None,
    compile_plan: Optional[CompilePlan] = None,
    weights: Optional[dict[str, torch.Tensor]] = None,
) -> BuiltModel:
    """The run's model; ``precision`` None builds the plain (unquantized, SDPA) model.

    ``table`` picks the linear backends; unset loads ``precision.tuning_file``. ``compile_plan`` (the checked
    ``model.compile``/``model.fuse``) fuses and compiles it last; None leaves it eager (references).
    ``weights``: tensors by parameter name, already on the device in the compute dtype, assigned
    without a copy (``benchmarks/vs_diffusers.py`` shares one checkpoint in memory with diffusers).
    """
    geometry = model_geometry(model_cfg)
    with torch.device("meta"):
        model = FluxDiT(geometry)
    if weights is not None:
        model.load_state_dict(weights, strict=True, assign=True)
    elif model_cfg.path:
        load_pretrained_weights(model, transformer_folder(model_cfg.path), device_dtype.dtype, device_dtype.device)
    else:
        draw_random_weights(model, model_cfg.weights_seed, device_dtype.dtype, device_dtype.device)
    built = BuiltModel(model, ATTENTION_KERNELS.get("bf16").make("sdpa"))
    if precision is not None and precision.quantized:
        table = table or DispatchTable.load(precision.tuning_file, device_dtype.device, precision.backend, announce)
        built = _quantize(model, precision, table, device_dtype.device, geometry.attention_head_dim, announce)
    built.model.eval().requires_grad_(False)
    if compile_plan is not None:
        applied = apply_plan(built.model, compile_plan, built.attention)
        built.details["compile"] = {"mode": compile_plan.label, **applied}
        if compile_plan.graphs:
            built.forward = GraphedForward(built.model, built.attention)
            built.parts = ModelParts(
                GraphedForward(built.model.head, built.attention),
                GraphedForward(built.model.tail, built.attention),
                built.model.finish,
            )
    return built


def _quantize(
    model: FluxDiT, plan: PrecisionPlan, table: DispatchTable, device: torch.device, head_dim: int, announce: bool
) -> BuiltModel:
    quantize_model(model, plan.linear, plan.scale_mode, table.choose, plan.quantizer)
    table.say_untuned()
    implementation = choose_implementation(plan.attention, device, head_dim, fast=plan.backend != "emulation")
    if announce and plan.attention.quantized and implementation == EMULATION:
        why = fast_attention_available(plan.attention, device) or "precision.backend=emulation"
        print(
            f"ditrun: precision.attention={plan.attention.name} runs as the torch reference here ({why}).", flush=True
        )
    details = {c: {"format": f.name, "backends": _backends_of(model, f.name)} for c, f in plan.linear.items()}
    payload = payload_for(plan.attention.name, implementation) if plan.quantized_exchange else None
    exchange = "codes" if payload is not None else "values"
    details["attention"] = {"format": plan.attention.name, "backends": [implementation], "exchange": exchange}
    details["quantizer"] = plan.quantizer
    return BuiltModel(model, plan.attention.make(implementation), plan, details, payload=payload)


def _backends_of(model: FluxDiT, fmt: str) -> list[str]:
    return sorted(
        {name for m in model.modules() if isinstance(m, QuantizedLinear) and m.fmt.name == fmt for name in m.backends}
    )


def inexact_repack_rows(model: FluxDiT) -> dict[str, int]:
    """Rows of the MX -> FP8 repack that were not exact: weights (at load) and activations (so far)."""
    total = {"weight": 0, "activation": 0}
    for module in model.modules():
        for backend in getattr(module, "backends", {}).values():
            counts = getattr(backend, "inexact_rows", None)
            if counts is not None:
                total["weight"] += counts["weight"]
                total["activation"] += int(counts["activation"] or 0)
    return total
