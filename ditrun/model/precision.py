"""The precision plan: the ``precision.*`` config checked against the registries of linear formats and attention
kernels (``kernels/linear.py``, ``kernels/attention.py``: their names are the allowed values, here and in the docs),
before any weight is read, and what a plan is called in records (``precision_label``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ditrun.config import precision_preset
from ditrun.errors import UserError
from ditrun.kernels.attention import ATTENTION_KERNELS, AttentionKernel, fast_attention_available
from ditrun.kernels.formats import SCALE_MODES
from ditrun.kernels.linear import LINEAR_BACKENDS, LINEAR_FORMATS, QUANTIZERS, LinearFormat
from ditrun.kernels.tuning import BACKEND_MODES, DispatchTable, default_table_path
from ditrun.model.components import LINEAR_COMPONENTS


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
    quantizer: str = "compiled"
    """``precision.quantizer``: how a compiled block quantizes activations (``kernels.linear.QUANTIZERS``)."""

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
    if precision_cfg.quantizer not in QUANTIZERS:
        raise UserError(
            f"precision.quantizer={precision_cfg.quantizer!r} is unknown; allowed: {', '.join(QUANTIZERS)}."
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
        precision_cfg.quantizer,
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
