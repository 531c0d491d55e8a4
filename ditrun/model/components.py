"""Which linears of ``FluxDiT`` each precision component covers: the one place that says so.

Patterns are ``fnmatch`` patterns over ``named_modules()`` names (``*`` also matches dots).
Linears not listed (embedders, AdaLN modulation, the final projection) always run unquantized:
they are a small share of the FLOPs and the conditioning path is the most sensitive to error.

The single-stream block's ``proj_out`` takes the concatenation [attention output, MLP output]
and is both the attention's output projection and the MLP's down projection. Four fifths of its
input channels (and its FLOPs) are the MLP's, and its input is read once, so it belongs to ``mlp``
as a whole rather than being split into two GEMMs with two formats.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

COMPONENT_LINEARS: dict[str, tuple[str, ...]] = {
    "qkv": (
        "*.attn.to_q",
        "*.attn.to_k",
        "*.attn.to_v",
        "*.attn.to_gate",
        "*.attn.add_q_proj",
        "*.attn.add_k_proj",
        "*.attn.add_v_proj",
        "*.attn.add_gate",
    ),
    "out": ("*.attn.to_out.0", "*.attn.to_add_out"),
    "mlp": (
        "*.ff.net.0.proj",
        "*.ff.net.2",
        "*.ff_context.net.0.proj",
        "*.ff_context.net.2",
        "single_transformer_blocks.*.proj_mlp",
        "single_transformer_blocks.*.proj_out",
    ),
}
"""Component -> the linears it covers. ``attention`` (the fourth component) is a kernel, not a linear."""

LINEAR_COMPONENTS = tuple(COMPONENT_LINEARS)

# Projections of an ``Attention`` module that read the same normalized input; when quantized they
# are stacked into one GEMM so that the input is quantized once. Order = output order.
STACKED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "image": ("to_q", "to_k", "to_v", "to_gate"),
    "text": ("add_q_proj", "add_k_proj", "add_v_proj", "add_gate"),
}


def component_of(module_name: str) -> str | None:
    """The precision component a module belongs to, or None if it is never quantized."""
    for component, patterns in COMPONENT_LINEARS.items():
        if any(fnmatchcase(module_name, p) for p in patterns):
            return component
    return None


def component_linears(model: nn.Module) -> dict[str, list[str]]:
    """Component -> names of the model's ``nn.Linear`` modules it covers."""
    found: dict[str, list[str]] = {c: [] for c in COMPONENT_LINEARS}
    for name, module in model.named_modules():
        component = component_of(name)
        if component is not None and isinstance(module, nn.Linear):
            found[component].append(name)
    return found
