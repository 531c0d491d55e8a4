"""The attention primitive every other piece builds on: the signature of an attention function, and PyTorch's SDPA.

Kept apart from the model (``model/dit.py`` calls attention through this signature) and from the quantized
kernels (``kernels/attention.py`` registers SDPA as the ``bf16`` kernel), so that both import it from below.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# q, k, v: [B, S, H, D] -> [B, S, H, D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) attention with PyTorch's fused kernels."""
    # [B, S, H, D] -> [B, H, S, D] and back
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)
