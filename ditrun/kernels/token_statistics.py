"""Statistics over all of a sequence's tokens that do not depend on how the tokens are split.

Quantized attention smooths K by its mean over the tokens (``attention.smooth_k``, ``fp8_sdpa``). A
sequence-parallel rank that quantizes its own tokens before the exchange (``parallel/ulysses.py``) only sees
its share of them, so the mean is a sum over ranks. Summed in fp64, each BF16 value is exact and so is every
partial sum unless a tensor's values span more than 53 - 8 - log2(S) binades (below 2^-29 of the largest at
S = 2^16): the sum is then the same whichever split and order made it, and one process, a BF16 exchange and a
quantized exchange smooth K alike. Where it is inexact (more often for fp32 values, the CPU's compute dtype),
only its last fp64 bits can depend on the order, which changes the mean rounded to the model's dtype only when
it lies that close to a rounding boundary. A maximum is exact in any order.
"""

from __future__ import annotations

import torch

from ditrun.kernels.linear import triton_available


def token_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """The sum of ``x`` over its token dim ``dim``, in fp64 (exact; see the module doc).

    A GPU's [B, L, H, D] tensor (eager) is summed by a Triton kernel that widens each tile in registers:
    ``sum(dtype=float64)`` would first copy the whole tensor to fp64 (four times a BF16 K, every attention call).
    Compiled code keeps the torch statement, which inductor fuses the same way."""
    if _summed_by_kernel(x, dim):
        from ditrun.kernels.token_sum_triton import token_sum_fp64

        total = token_sum_fp64(x)
        return total.unsqueeze(1) if keepdim else total
    return x.sum(dim=dim, keepdim=keepdim, dtype=torch.float64)


def _summed_by_kernel(x: torch.Tensor, dim: int) -> bool:
    d = x.shape[-1]
    return (
        triton_available(x.device)
        and not torch.compiler.is_compiling()
        and x.dim() == 4
        and dim == 1
        and d & (d - 1) == 0
        and x.stride(-1) == 1
    )


def token_mean(total: torch.Tensor, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The mean of ``tokens`` tokens whose ``token_sum`` is ``total``, rounded once to ``dtype``."""
    return (total / max(tokens, 1)).to(dtype)


def token_amax(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |x| over ``dims`` in fp64 (exact); 0 where there is nothing to reduce (a rank holding no tokens)."""
    if x.numel() == 0:
        shape = [n for i, n in enumerate(x.shape) if i not in {d % x.dim() for d in dims}]
        return torch.zeros(shape, dtype=torch.float64, device=x.device)
    return x.abs().amax(dim=dims).double()
