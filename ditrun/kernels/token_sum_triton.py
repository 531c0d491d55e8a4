"""The fp64 sum of a GPU tensor's tokens in one Triton kernel (``token_statistics.token_sum``'s GPU path), kept
apart from the attention kernels so that ``token_statistics`` (which they use) needs none of them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_sum_kernel(X, OUT, L, H, stride_xb, stride_xl, stride_xh, D: tl.constexpr, BLOCK_L: tl.constexpr):
    # X: [B, L, H, D] (any strides, D contiguous); OUT: fp64 [B, H, D], zeros before the launch. One program: the
    # fp64 sum of BLOCK_L tokens of one (batch, head), added by atomics (exact sums: any order gives the same).
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    tokens = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    dims = tl.arange(0, D)
    rows = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + tokens[:, None].to(tl.int64) * stride_xl
    x = tl.load(rows + dims[None, :], mask=tokens[:, None] < L, other=0.0)
    tl.atomic_add(OUT + bh.to(tl.int64) * D + dims, tl.sum(x.to(tl.float64), 0))


def token_sum_fp64(x: torch.Tensor, block_l: int = 64) -> torch.Tensor:
    """x [B, L, H, D] (D contiguous, a power of two) -> its fp64 sum over the tokens [B, H, D]
    (``token_statistics.token_sum``) without an fp64 copy of x."""
    b, length, h, d = x.shape
    out = torch.zeros(b, h, d, dtype=torch.float64, device=x.device)
    grid = (max(1, triton.cdiv(length, block_l)), b * h)
    _token_sum_kernel[grid](x, out, length, h, x.stride(0), x.stride(1), x.stride(2), D=d, BLOCK_L=block_l, num_warps=4)
    return out
