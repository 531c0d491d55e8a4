"""The names of the compute dtypes a run may choose, and of the device it runs on."""

from __future__ import annotations

import platform

import torch

# ``model.dtype`` and ``metrics.full_quality_dtype`` name one of these.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16``, ``fp16`` or ``fp32``; another dtype by torch's name for it."""
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's (its processor, else its machine type)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()
