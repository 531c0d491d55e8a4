"""The Triton flash-attention kernel of INT8-QK attention (GPU only; imported on first use).

One program per (block of BLOCK_M queries, batch x head): the Q tile stays in registers, K/V tiles
of BLOCK_N tokens stream through. Q.K^T is a tensor-core dot of INT8 operands (int32, exact) times
per-token scales; the scales and sm_scale * log2(e) are folded so that the online softmax runs on exp2,
in fp32. INT8 sums are converted to fp32 by adding them to the bits of 1.5 * 2^23 (two full-rate
instructions, exact) rather than by I2F. P @ V runs in V's dtype (FP8-exact and MXFP6 values are exact
in BF16).

Tile sizes and pipelining are autotuned per (S, D) from a short list (see CONFIGS). When S is a
multiple of BLOCK_N the key loop runs without masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditrun.kernels import formats
from ditrun.kernels.quantize_triton import ROUND_MAGIC
from ditrun.kernels.token_statistics import token_mean, token_sum

LOG2_E = 1.4426950408889634
INT_MAGIC = tl.constexpr(0x4B400000)
"""The bits of 1.5 * 2^23: adding an int32 n (|n| < 2^22) to them gives the fp32 1.5 * 2^23 + n exactly,
so subtracting ROUND_MAGIC converts n to fp32 with two full-rate instructions instead of I2F, which runs
at a sixteenth of the FMA rate on Hopper (INT8 Q.K sums stay below 127^2 * 256 < 2^22)."""


def _config(m, n, w, s):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)


# On one H200 (Triton 3.6, S = 20992, D = 128) 128 x 64 tiles on 4 warps, 3 stages, were fastest
# (`benchmarks/attention.py --configs`). The list keeps that one's neighbours, and smaller tiles for GPUs
# with less shared memory.
CONFIGS = [
    _config(m, n, w, s)
    for m, n, w, s in [
        (128, 64, 4, 3),
        (128, 64, 4, 2),
        (128, 64, 4, 4),
        (128, 32, 4, 3),
        (128, 128, 8, 3),
        (128, 64, 8, 4),
        (64, 64, 4, 3),
        (64, 128, 4, 3),
    ]
]


@triton.jit
def _attention_forward(
    Q,
    QS,
    K,
    KS,
    V,
    O,
    sm_scale_log2,
    S,
    H,
    stride_b,
    stride_h,
    stride_s,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    # Q, K: int8 [B, H, S, D]; QS, KS: fp32 [B, H, S], one scale per token; V, O: [B, H, S, D] with Q's strides.
    block_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    base = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    q = tl.load(Q + base + rows[:, None] * stride_s + dims[None, :], mask=rows[:, None] < S, other=0.0)
    scales = bh.to(tl.int64) * S
    q_scale = tl.load(QS + scales + rows, mask=rows < S, other=1.0) * sm_scale_log2  # > 0: see below
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in tl.range(0, S, BLOCK_N):
        keys = start + cols
        if EVEN_N:
            k = tl.load(K + base + keys[:, None] * stride_s + dims[None, :])
            k_scale = tl.load(KS + scales + keys)
        else:
            k = tl.load(K + base + keys[:, None] * stride_s + dims[None, :], mask=keys[:, None] < S, other=0.0)
            k_scale = tl.load(KS + scales + keys, mask=keys < S, other=0.0)
        raw = (tl.dot(q, tl.trans(k), out_dtype=tl.int32) + INT_MAGIC).to(tl.float32, bitcast=True) - ROUND_MAGIC
        raw = raw * k_scale[None, :]
        if not EVEN_N:
            raw = tl.where(keys[None, :] < S, raw, float("-inf"))
        # The scores in log2 units are q_scale * raw; as q_scale > 0, the row max is q_scale * max(raw),
        # and q_scale * raw - m is one FMA per score (the softmax, not the dots, bounds this loop).
        m_new = tl.maximum(m_i, tl.max(raw, 1) * q_scale)
        p = tl.math.exp2(raw * q_scale[:, None] - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EVEN_N:
            v = tl.load(V + base + keys[:, None] * stride_s + dims[None, :])
        else:
            v = tl.load(V + base + keys[:, None] * stride_s + dims[None, :], mask=keys[:, None] < S, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + base + rows[:, None] * stride_s + dims[None, :], out.to(O.dtype.element_ty), mask=rows[:, None] < S)


_fixed = triton.heuristics({"EVEN_N": lambda args: args["S"] % args["BLOCK_N"] == 0})(_attention_forward)
_tuned = triton.autotune(configs=CONFIGS, key=["S", "D"])(_fixed)


def flash_attention(q, q_scale, k, k_scale, v, sm_scale: float, config: dict | None = None) -> torch.Tensor:
    """INT8 [B, H, S, D] q, k with fp32 per-token scales [B, H, S], and v -> [B, H, S, D] in v's dtype.
    ``config``: fixed kernel parameters (``BLOCK_M``, ``BLOCK_N``, optionally ``num_warps``, ``num_stages``)
    instead of autotuning (Triton's CPU interpreter cannot time)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_scale, k_scale = q_scale.contiguous(), k_scale.contiguous()
    b, h, s, d = q.shape
    out = torch.empty(q.shape, dtype=v.dtype, device=q.device)

    def grid(meta):
        return triton.cdiv(s, meta["BLOCK_M"]), b * h

    args = (q, q_scale, k, k_scale, v, out, sm_scale * LOG2_E, s, h, q.stride(0), q.stride(1), q.stride(2))
    if config is None:
        _tuned[grid](*args, D=d)
    else:
        _fixed[grid](*args, D=d, **config)
    return out


@triton.jit
def _quantize_qk_kernel(
    X,
    MEAN,
    Y,
    SCALE,
    S,
    H,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_mb,
    stride_mh,
    SMOOTH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # X: [B, S, H, D] (any strides, D contiguous); MEAN: [B, H, D] in X's dtype, read when SMOOTH;
    # Y: int8 [B, H, S, D]; SCALE: fp32 [B, H, S]. One program: BLOCK_S tokens of one (batch, head).
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    tokens = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    mask = tokens[:, None] < S
    x = tl.load(
        X + b.to(tl.int64) * stride_xb + h * stride_xh + tokens[:, None].to(tl.int64) * stride_xs + dims[None, :],
        mask=mask,
        other=0.0,
    )
    if SMOOTH:  # as smooth_k: the difference rounded to X's dtype
        mean = tl.load(MEAN + b * stride_mb + h * stride_mh + dims)
        x = (x.to(tl.float32) - mean.to(tl.float32)[None, :]).to(x.dtype)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    steps = tl.math.div_rn(x, scale[:, None])
    codes = tl.minimum(tl.maximum((steps + ROUND_MAGIC) - ROUND_MAGIC, -127.0), 127.0)  # round half to even
    rows = bh.to(tl.int64) * S + tokens
    tl.store(Y + rows[:, None] * D + dims[None, :], codes.to(tl.int8), mask=mask)
    tl.store(SCALE + rows, scale, mask=tokens < S)


def quantize_qk(x: torch.Tensor, smooth: bool, block_s: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S, H, D] -> (int8 [B, H, S, D], fp32 scale [B, H, S]): ``quantize_int8_rows`` of x transposed
    (of ``smooth_k`` of it when ``smooth``) in one pass, the transpose included."""
    b, s, h, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    mean = token_mean(token_sum(x, 1), s, x.dtype) if smooth else x  # [B, H, D], as smooth_k; x: unread
    codes = torch.empty(b, h, s, d, dtype=torch.int8, device=x.device)
    scale = torch.empty(b, h, s, dtype=torch.float32, device=x.device)
    _quantize_qk_kernel[(triton.cdiv(s, block_s), b * h)](
        x,
        mean,
        codes,
        scale,
        s,
        h,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        mean.stride(0),
        mean.stride(1),
        SMOOTH=smooth,
        D=d,
        BLOCK_S=block_s,
        num_warps=4,
    )
    return codes, scale


@triton.jit
def _head_amax_kernel(X, AMAX, S, H, stride_xb, stride_xs, stride_xh, D: tl.constexpr, BLOCK_S: tl.constexpr):
    # X: [B, S, H, D] (any strides, D contiguous); AMAX: fp32 [B * H], zeros before the launch. One program: the
    # max of |x| over BLOCK_S tokens of one (batch, head), into AMAX by an atomic max (exact in any order).
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    tokens = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    rows = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + tokens[:, None].to(tl.int64) * stride_xs
    x = tl.load(rows + dims[None, :], mask=tokens[:, None] < S, other=0.0)
    tl.atomic_max(AMAX + bh, tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0))


@triton.jit
def _fp8_v_codes_kernel(
    V, SCALE_INV, OUT, S, S_PAD, H, stride_vb, stride_vs, stride_vh, D: tl.constexpr, BLOCK: tl.constexpr
):
    # V: [B, S, H, D] (any strides, D contiguous); SCALE_INV: fp32 [B * H]; OUT: E4M3 [B * H * D, S_PAD], V^T
    # with the keys reordered within each 32 (``fp8_v_codes``). One program: BLOCK stored keys of one head.
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # stored key positions
    r = k % 32
    src = k - r + (r // 16) * 16 + ((r // 2) % 2) * 8 + ((r // 4) % 4) * 2 + r % 2  # the key stored there
    d = tl.arange(0, D)
    head = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh  # 64-bit: [B, H, S, D] views have large strides
    x = tl.load(head + src[:, None].to(tl.int64) * stride_vs + d[None, :], mask=(src < S)[:, None], other=0.0)
    codes = (x.to(tl.float32) * tl.load(SCALE_INV + bh)).to(tl.float8e4nv)  # round to nearest even
    tl.store(OUT + (bh * D + d).to(tl.int64)[None, :] * S_PAD + k[:, None], codes, mask=(k < S_PAD)[:, None])


def fp8_v_codes(v: torch.Tensor, block_s: int = 128, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """V [B, S, H, D] (BF16/FP16, any strides with D contiguous) -> ``attention.fp8_v_codes`` of V [B, H, S, D]:
    (E4M3 codes of ``quantize_v(v, "fp8")`` as V^T [B * H * D, S rounded up to 32], keys reordered within each 32,
    zeros past S; the fp32 power-of-two scale per head [B * H]). Two passes over V: the heads' amax, then the
    codes (V times the inverse of its head's scale, rounded to E4M3 by the hardware's round to nearest even)."""
    b, s, h, d = v.shape
    if v.stride(-1) != 1:
        v = v.contiguous()
    amax = torch.zeros(b * h, dtype=torch.float32, device=v.device)
    _head_amax_kernel[(triton.cdiv(s, block_s), b * h)](
        v, amax, s, h, v.stride(0), v.stride(1), v.stride(2), D=d, BLOCK_S=block_s, num_warps=4
    )
    scale = formats.fp8_power_of_two_scale(amax)  # as attention.fp8_head_exponents: rceil, exact
    padded = -(-s // 32) * 32
    codes = torch.empty(b * h * d, padded, dtype=torch.float8_e4m3fn, device=v.device)
    _fp8_v_codes_kernel[(triton.cdiv(padded, block), b * h)](
        v, 1 / scale, codes, s, padded, h, v.stride(0), v.stride(1), v.stride(2), D=d, BLOCK=block, num_warps=4
    )
    return codes, scale
