"""Quantize a built model per its precision map: every linear of a quantized component is replaced
by a ``QuantizedLinear`` whose weights are converted here, once.

Q, K, V (and the gate) of one stream read the same normalized input: when they share a format
they are stacked into one ``QuantizedLinear`` so the input is quantized once, in one GEMM.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ditrun.kernels.linear import LinearBackend, LinearFormat, QuantizedLinear
from ditrun.model.components import STACKED_PROJECTIONS, component_linears, component_of
from ditrun.model.dit import Attention

# (format, K, N) -> (backends to prepare weights for, M -> backend name)
BackendChoice = Callable[[LinearFormat, int, int], tuple[dict[str, LinearBackend], Callable[[int], str]]]


def _quantized(
    linears: list[nn.Linear],
    fmt: LinearFormat,
    scale_mode: str,
    choose: BackendChoice,
    stacked: bool,
    quantizer: str = "compiled",
) -> QuantizedLinear:
    weight = torch.cat([lin.weight for lin in linears]) if stacked else linears[0].weight
    biases = [lin.bias for lin in linears]
    bias = None if any(b is None for b in biases) else torch.cat(biases)
    backends, pick = choose(fmt, weight.shape[1], weight.shape[0])
    splits = [lin.out_features for lin in linears] if stacked else None
    return QuantizedLinear(weight.detach(), bias, fmt, scale_mode, backends, pick, splits, quantizer)


def _stack_projections(attn: Attention, fmt: LinearFormat, scale_mode: str, choose: BackendChoice) -> None:
    for stream, names in STACKED_PROJECTIONS.items():
        linears = [getattr(attn, n, None) for n in names]
        linears = [lin for lin in linears if lin is not None]
        if not linears:
            continue  # a single-stream block has no text projections
        attn.stacked[stream] = _quantized(linears, fmt, scale_mode, choose, stacked=True)
        for name in names:  # the originals are now inside the stack: free them
            if getattr(attn, name, None) is not None:
                setattr(attn, name, None)


def quantize_model(
    model: nn.Module,
    formats: dict[str, LinearFormat],
    scale_mode: str,
    choose: BackendChoice,
    quantizer: str = "compiled",
) -> dict[str, int]:
    """Replace the linears of each quantized component in place; returns linears replaced per component.
    ``quantizer``: ``precision.quantizer`` (``kernels.linear.QUANTIZERS``)."""
    replaced = {component: 0 for component in formats}
    for component, names in component_linears(model).items():
        fmt = formats[component]
        if not fmt.quantized:
            continue
        for name in names:
            if component == "qkv":
                continue  # stacked per attention module below
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, _quantized([getattr(parent, child)], fmt, scale_mode, choose, False, quantizer))
            replaced[component] += 1
    if formats["qkv"].quantized:
        for name, module in model.named_modules():
            if isinstance(module, Attention) and component_of(f"{name}.to_q") == "qkv":
                _stack_projections(module, formats["qkv"], scale_mode, choose)
                replaced["qkv"] += len(module.stacked)
    return replaced
