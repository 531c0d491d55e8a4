"""Building the model a run measures, in one path that reads top to bottom:

geometry -> module on ``meta`` (no memory) -> weights (read or drawn straight onto the device in
the compute dtype) -> quantized per the precision map (weights converted once) -> placed (eval,
no grad). Weights go to the device before quantizing because quantizing a 12B model is a GPU
job; quantizing only shrinks what is already there, so nothing is held twice at full size.

Every precision check a config can fail runs in ``plan_precision``, before any weight is read,
from the registries of linear formats and attention kernels (``kernels/linear.py``,
``kernels/attention.py``): their names are the allowed values, here and in the docs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ditrun.config import precision_preset
from ditrun.devices import DTYPES, dtype_name
from ditrun.errors import UserError
from ditrun.kernels.attention import (
    ATTENTION_KERNELS,
    EMULATION,
    AttentionKernel,
    choose_implementation,
    fast_attention_available,
)
from ditrun.kernels.attention_payload import Payload, payload_for
from ditrun.kernels.formats import SCALE_MODES
from ditrun.kernels.linear import LINEAR_BACKENDS, LINEAR_FORMATS, LinearFormat, QuantizedLinear
from ditrun.kernels.sdpa import AttentionFn
from ditrun.kernels.tuning import BACKEND_MODES, DispatchTable, default_table_path
from ditrun.model.compile import CompilePlan, apply_plan
from ditrun.model.components import LINEAR_COMPONENTS
from ditrun.model.dit import DiTGeometry, FluxDiT
from ditrun.model.folders import transformer_folder
from ditrun.model.graphs import GraphedForward
from ditrun.model.load import checkpoint_geometry, draw_random_weights, load_pretrained_weights
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
# Precision: the checked plan, and what it is called in records


@dataclass(frozen=True)
class PrecisionPlan:
    """The checked ``precision.*`` config: a format per linear component and an attention kernel."""

    name: str
    linear: dict[str, LinearFormat]
    attention: AttentionKernel
    backend: str
    scale_mode: str
    tuning_file: Optional[Path] = None
    quantized_exchange: bool = True
    """``precision.quantized_exchange``: a quantized attention's exchange carries its codes."""

    @property
    def quantized(self) -> bool:
        return self.attention.quantized or any(f.quantized for f in self.linear.values())

    def formats(self) -> dict[str, str]:
        """Component -> format name, the attention included."""
        return {**{c: f.name for c, f in self.linear.items()}, "attention": self.attention.name}


def plan_precision(precision_cfg, device: torch.device) -> PrecisionPlan:
    """Check ``precision.*`` against the registries (and, for ``backend=fast``, against the device)."""
    linear = {c: LINEAR_FORMATS.get(getattr(precision_cfg, c), f"precision.{c}") for c in LINEAR_COMPONENTS}
    attention = ATTENTION_KERNELS.get(precision_cfg.attention, "precision.attention")
    if precision_cfg.backend not in BACKEND_MODES and precision_cfg.backend not in LINEAR_BACKENDS:
        modes = ", ".join(mode for mode in BACKEND_MODES if mode not in LINEAR_BACKENDS)
        raise LINEAR_BACKENDS.unknown(precision_cfg.backend, extra=modes)
    if precision_cfg.scale_mode not in SCALE_MODES:
        raise UserError(
            f"precision.scale_mode={precision_cfg.scale_mode!r} is unknown; allowed: {', '.join(SCALE_MODES)}."
        )
    tuning = Path(precision_cfg.tuning_file) if precision_cfg.tuning_file else default_table_path()
    plan = PrecisionPlan(
        precision_cfg.name,
        linear,
        attention,
        precision_cfg.backend,
        precision_cfg.scale_mode,
        tuning,
        precision_cfg.quantized_exchange,
    )
    if plan.backend == "fast":
        _check_fast(plan, device)
    return plan


def _check_fast(plan: PrecisionPlan, device: torch.device) -> None:
    table = DispatchTable(device, "fast", announce=False)
    for component, fmt in plan.linear.items():
        if fmt.quantized and not table.candidates(fmt):
            raise UserError(
                f"precision.backend=fast but precision.{component}={fmt.name} has no fast backend on "
                f"{device.type}; use precision.backend=auto (exact emulation) or another format."
            )
    why = fast_attention_available(plan.attention, device)
    if why is not None:
        raise UserError(
            f"precision.backend=fast but precision.attention={plan.attention.name} {why}; "
            "use precision.backend=auto or another kernel."
        )


def _preset_formats(name: str) -> Optional[dict]:
    preset = precision_preset(name)
    if preset is None:
        return None
    return {k: preset.get(k, "bf16") for k in (*LINEAR_COMPONENTS, "attention")}


def precision_label(plan: PrecisionPlan, dtype_name: str) -> str:
    """What ran, in one word: the compute dtype when nothing is quantized (a CPU "bf16" run is
    ``fp32``); else the preset's name (or ``component=format`` pairs when the map is not a preset's),
    with ``+<dtype>`` when the unquantized parts did not run in bf16."""
    if not plan.quantized:
        return dtype_name
    formats = plan.formats()
    if _preset_formats(plan.name) == formats:
        label = plan.name
    else:
        label = ",".join(f"{c}={f}" for c, f in formats.items() if f != "bf16")
    return label if dtype_name == "bf16" else f"{label}+{dtype_name}"


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
    quantize_model(model, plan.linear, plan.scale_mode, table.choose)
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
