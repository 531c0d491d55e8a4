"""The fused Q/K producer of the quantized exchange (GPU only; imported on first use): per-head RMSNorm, RoPE and
INT8 quantization in one Triton kernel that writes the codes and scales straight into the exchange's send rows.

The unfused sequence it replaces is the model's ``norm_q``/``norm_k`` (``nn.RMSNorm``), ``dit.apply_rope`` and
``attention_payload.Int8QKPayload.encode``'s Q/K part (``quantize_int8_rows``, K smoothed by the whole sequence's
mean; ``tests/test_qk_producer.py`` writes it out): three passes over a [B, L, H, D] BF16 tensor and two BF16
intermediates. Here one program holds BLOCK_L tokens of one (batch row, head) in registers: the channel pairs RoPE
mixes are read as a second, permuted load of the same tile (from L1), each rounding to the model dtype that the
unfused code makes is made at the same point, and the codes and fp32 scales are stored through the caller's strides
— the send slot's field views (``RowLayout.views``), destination-major as ``UlyssesAttention`` lays them out.

K's smoothing needs the mean of the normalized, rotated K over every token before any code is written:
``norm_rope_statistics`` is a first pass that recomputes them and adds their fp64 sums (exact for BF16 values,
``token_statistics.py``) and their amax per (batch row, head) by atomics, the rank's share of ``Statistics``.

Arithmetic: the norm's mean square is an fp32 tree sum and ``rsqrt`` is the GPU's, so a normalized value may differ
from torch's in its last bit, and a code by one where that value sits on a rounding boundary: the tests allow that
(``tests/test_qk_producer.py``); the CPU runs the torch composition, whose codes are the BF16 exchange's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditrun.kernels.quantize_triton import ROUND_MAGIC


@triton.jit
def _norm_rope(X, W, COS, SIN, b, h, tokens, L, stride_xb, stride_xl, stride_xh, eps, D: tl.constexpr):
    # -> the normalized, rotated [BLOCK_L, D] tile in fp32, each value rounded to X's dtype as the unfused code does
    dims = tl.arange(0, D)
    partner = dims ^ 1  # RoPE rotates channel pairs (2i, 2i + 1)
    rows = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + tokens[:, None].to(tl.int64) * stride_xl
    mask = tokens[:, None] < L
    x = tl.load(rows + dims[None, :], mask=mask, other=0.0)
    x_partner = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]
    y = (xf * inv_rms * tl.load(W + dims).to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
    y_partner = (x_partner * inv_rms * tl.load(W + partner).to(tl.float32)[None, :]).to(x.dtype).to(tl.float32)
    rotated = tl.where((dims % 2 == 0)[None, :], -y_partner, y_partner)
    table = tokens[:, None].to(tl.int64) * D + dims[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0)
    sin = tl.load(SIN + table, mask=mask, other=0.0)
    return (y * cos + rotated * sin).to(x.dtype).to(tl.float32)


@triton.jit
def _statistics_kernel(
    X, W, COS, SIN, KSUM, AMAX, L, H, stride_xb, stride_xl, stride_xh, eps, D: tl.constexpr, BLOCK_L: tl.constexpr
):
    # KSUM: fp64 [B, H, D], AMAX: fp32 [B, H], zeros before the launch; one program: BLOCK_L tokens of one (b, h)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    tokens = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    y = _norm_rope(X, W, COS, SIN, b, h, tokens, L, stride_xb, stride_xl, stride_xh, eps, D)
    y = tl.where((tokens < L)[:, None], y, 0.0)
    tl.atomic_add(KSUM + bh.to(tl.int64) * D + tl.arange(0, D), tl.sum(y.to(tl.float64), 0))
    tl.atomic_max(AMAX + bh, tl.max(tl.max(tl.abs(y), 1), 0))


@triton.jit
def _quantize_kernel(
    X,
    W,
    COS,
    SIN,
    MEAN,
    CODES,
    SCALE,
    L,
    H,
    HP,
    stride_xb,
    stride_xl,
    stride_xh,
    stride_cb,
    stride_cl,
    stride_cp,
    stride_ch,
    stride_sb,
    stride_sl,
    stride_sp,
    stride_sh,
    eps,
    SMOOTH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    # MEAN: [B, H, D] in X's dtype (read when SMOOTH); CODES: int8 [B, L, P, HP, D] and SCALE: fp32 [B, L, P, HP] (the
    # H = P * HP heads split by destination rank), any strides (D contiguous): the send slot's fields. One program:
    # BLOCK_L tokens of one (b, h).
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    tokens = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    dims = tl.arange(0, D)
    y = _norm_rope(X, W, COS, SIN, b, h, tokens, L, stride_xb, stride_xl, stride_xh, eps, D)
    if SMOOTH:  # as attention.smooth_k: the difference rounded to X's dtype
        mean = tl.load(MEAN + bh.to(tl.int64) * D + dims).to(tl.float32)
        y = (y - mean[None, :]).to(X.dtype.element_ty).to(tl.float32)
    amax = tl.max(tl.abs(y), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    steps = tl.math.div_rn(y, scale[:, None])
    codes = tl.minimum(tl.maximum((steps + ROUND_MAGIC) - ROUND_MAGIC, -127.0), 127.0)  # round half to even
    mask = tokens < L
    p, hp = (h // HP).to(tl.int64), (h % HP).to(tl.int64)
    at = b.to(tl.int64) * stride_cb + p * stride_cp + hp * stride_ch + tokens.to(tl.int64) * stride_cl
    tl.store(CODES + at[:, None] + dims[None, :], codes.to(tl.int8), mask=mask[:, None])
    at = b.to(tl.int64) * stride_sb + p * stride_sp + hp * stride_sh + tokens.to(tl.int64) * stride_sl
    tl.store(SCALE + at, scale, mask=mask)


BLOCK_L, WARPS = 16, 4
"""Tokens per program and warps per program of both kernels: the fastest of `benchmarks/qk_producer.py --tune` on
one H100 at P = 2, 4 and 8 (docs/TRANSPORT.md)."""


def _tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cos.float().contiguous(), sin.float().contiguous()


def norm_rope_statistics(x, weight, cos, sin, eps: float = 1e-6, block_l: int = BLOCK_L, num_warps: int = WARPS):
    """x [B, L, H, D] (the projection's heads, D contiguous) -> the fp64 token sums [B, H, D] and the amax [B, H]
    (fp32) of RMSNorm(x) * weight rotated by (cos, sin) [L, D]: K's share of ``attention_payload.Statistics``."""
    b, length, h, d = x.shape
    k_sum = torch.zeros(b, h, d, dtype=torch.float64, device=x.device)
    amax = torch.zeros(b, h, dtype=torch.float32, device=x.device)
    cos, sin = _tables(cos, sin)
    grid = (max(1, triton.cdiv(length, block_l)), b * h)
    _statistics_kernel[grid](
        x, weight, cos, sin, k_sum, amax, length, h, *x.stride()[:3], eps, D=d, BLOCK_L=block_l, num_warps=num_warps
    )
    return k_sum, amax


def norm_rope_quantize(
    x, weight, cos, sin, codes, scale, mean=None, eps: float = 1e-6, block_l: int = BLOCK_L, num_warps: int = WARPS
) -> None:
    """RMSNorm(x) * weight, rotated by (cos, sin) [L, D], minus ``mean`` [B, H, D] if given, quantized to INT8 with a
    scale per token and head, written into ``codes`` (int8 [B, L, H, D]) and ``scale`` (fp32 [B, L, H]), or, heads
    split by destination rank, [B, L, P, H/P, D] and [B, L, P, H/P]: views of any strides, such as the send slot's
    fields (``UlyssesAttention`` writes them destination-major). x: [B, L, H, D], D contiguous."""
    b, length, h, d = x.shape
    if codes.dim() == 4:  # one destination
        codes, scale = codes.unsqueeze(2), scale.unsqueeze(2)
    per_destination = codes.shape[3]
    cos, sin = _tables(cos, sin)
    smooth = mean is not None
    mean = mean.contiguous() if smooth else x
    grid = (max(1, triton.cdiv(length, block_l)), b * h)
    _quantize_kernel[grid](
        x,
        weight,
        cos,
        sin,
        mean,
        codes,
        scale,
        length,
        h,
        per_destination,
        *x.stride()[:3],
        *codes.stride()[:4],
        *scale.stride()[:4],
        eps,
        SMOOTH=smooth,
        D=d,
        BLOCK_L=block_l,
        num_warps=num_warps,
    )
