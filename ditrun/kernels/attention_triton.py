"""The Triton flash-attention kernel of INT8-QK attention (GPU only; imported on first use).

One program per (block of BLOCK_M queries, batch x head): the INT8 Q tile stays in registers,
K/V tiles of BLOCK_N tokens stream through; Q.K^T is an INT8 tensor-core dot (int32, exact),
scaled by the outer product of the per-token scales, in which sm_scale * log2(e) is already
folded (so the online softmax runs on exp2, in fp32). P @ V runs in V's dtype: BF16 for
``int8qk``/``int8qk_mxfp6v`` (MXFP6 values are exact in BF16), and for ``int8qk_fp8v`` an FP8
tensor-core dot of FP8 V (one power-of-two scale per head, exact: see ``attention.quantize_v``)
and P scaled by 2^8 and cast to E4M3 (P <= 1, so P * 256 <= 256 < 448): the only extra rounding
of the FP8 path, P's 3-bit mantissa, against the reference's fp32 P (the tests bound it).

Tile sizes and pipelining are autotuned per (S, D, V dtype) from a short list that holds what
suits Hopper (BLOCK_M 128, BLOCK_N 64/128, 8 warps, 3-4 stages) and smaller tiles for other GPUs.
When S is a multiple of BLOCK_N the key loop runs without masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditrun.kernels import formats
from ditrun.kernels.quantize_triton import ROUND_MAGIC

LOG2_E = 1.4426950408889634
P_FP8_SCALE = tl.constexpr(256.0)
"""P (<= 1) times this is cast to E4M3 for the FP8 P @ V dot; a power of two, so it is exact to undo."""

CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
    for m, n, w, s in [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 4),
                       (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3)]
]


@triton.autotune(configs=CONFIGS, key=["S", "D", "V_FP8"])
@triton.heuristics({"EVEN_N": lambda args: args["S"] % args["BLOCK_N"] == 0})
@triton.jit
def _int8qk_forward(Q, QS, K, KS, V, VS, O, sm_scale_log2, S, H, stride_b, stride_h, stride_s, scale_b, scale_h,
                    stride_vb, stride_vh, stride_vs, stride_vd,
                    D: tl.constexpr, V_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_N: tl.constexpr):
    # Q, K: int8 [B, H, S, D]; QS, KS: fp32 [B, H, S]; V: [B, H, S, D] with its own strides (FP8 V is
    # stored token-contiguous, as FP8 tensor-core dots want their B operand); VS: fp32 [B * H]; O: like Q.
    block_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    base = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    v_base = b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    q = tl.load(Q + base + rows[:, None] * stride_s + dims[None, :], mask=rows[:, None] < S, other=0)
    scales = b * scale_b + h * scale_h
    q_scale = tl.load(QS + scales + rows, mask=rows < S, other=1.0) * sm_scale_log2  # > 0: see below
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, S, BLOCK_N):
        keys = start + cols
        k_ptrs = K + base + keys[:, None] * stride_s + dims[None, :]
        v_ptrs = V + v_base + keys[:, None] * stride_vs + dims[None, :] * stride_vd
        if EVEN_N:
            k = tl.load(k_ptrs)
            k_scale = tl.load(KS + scales + keys)
        else:
            k = tl.load(k_ptrs, mask=keys[:, None] < S, other=0)
            k_scale = tl.load(KS + scales + keys, mask=keys < S, other=0.0)
        # The scores in log2 units are q_scale * raw; as q_scale > 0, the row max is q_scale * max(raw),
        # and q_scale * raw - m is one FMA per score (the softmax, not the dots, bounds this loop).
        raw = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * k_scale[None, :]
        if not EVEN_N:
            raw = tl.where(keys[None, :] < S, raw, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(raw, 1) * q_scale)
        p = tl.math.exp2(raw * q_scale[:, None] - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EVEN_N:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=keys[:, None] < S, other=0.0)
        if V_FP8:
            pv = tl.dot((p * P_FP8_SCALE).to(v.dtype), v)
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if V_FP8:
        acc = acc * (tl.load(VS + bh) / P_FP8_SCALE)
    out = acc / l_i[:, None]
    tl.store(O + base + rows[:, None] * stride_s + dims[None, :], out.to(O.dtype.element_ty), mask=rows[:, None] < S)


def fp8_v_operand(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8-exact V [B, H, S, D] (``quantize_v(v, "fp8")``) -> (E4M3 codes stored [B, H, D, S] and viewed
    [B, H, S, D], fp32 power-of-two scale per head [B * H]). Exact: dividing values of the E4M3 grid
    times 2^e by a power of two that keeps the head's amax <= 448 lands on the grid again."""
    amax = v.float().abs().amax(dim=(-2, -1))
    scale = torch.ldexp(torch.ones_like(amax), formats.shared_exponents(amax, formats.FORMATS["fp8_e4m3"]).float())
    codes = (v.float() / scale[..., None, None]).to(torch.float8_e4m3fn)
    return codes.transpose(-1, -2).contiguous().transpose(-1, -2), scale.flatten().contiguous()


def int8qk_flash(ops, sm_scale: float, v_fp8: bool = False, tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """ops: ``Int8QK`` with [B, H, S, D] q, k (int8), v -> [B, H, S, D] in v's dtype.
    ``v_fp8``: V holds FP8-exact values (``int8qk_fp8v``): P @ V runs as an FP8 dot.
    ``tiles``: (BLOCK_M, BLOCK_N) instead of autotuning (Triton's CPU interpreter cannot time)."""
    q, k = ops.q.contiguous(), ops.k.contiguous()
    q_scale, k_scale = ops.q_scale.contiguous(), ops.k_scale.contiguous()
    b, h, s, d = q.shape
    out = torch.empty(q.shape, dtype=ops.v.dtype, device=q.device)
    v, v_scale = fp8_v_operand(ops.v) if v_fp8 else (ops.v.contiguous(), q_scale)  # q_scale: an unread stand-in

    def grid(meta):
        return triton.cdiv(s, meta["BLOCK_M"]), b * h

    fixed = {} if tiles is None else {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]}
    kernel = _int8qk_forward if tiles is None else _int8qk_forward.fn  # .fn: the heuristics, not autotuned
    kernel[grid](q, q_scale, k, k_scale, v, v_scale, out, sm_scale * LOG2_E, s, h,
                 q.stride(0), q.stride(1), q.stride(2), q_scale.stride(0), q_scale.stride(1),
                 v.stride(0), v.stride(1), v.stride(2), v.stride(3), D=d, V_FP8=v_fp8, **fixed)
    return out


@triton.jit
def _quantize_qk_kernel(X, MEAN, Y, SCALE, S, H, stride_xb, stride_xs, stride_xh, stride_mb, stride_mh,
                        SMOOTH: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    # X: [B, S, H, D] (any strides, D contiguous); MEAN: [B, H, D] in X's dtype, read when SMOOTH;
    # Y: int8 [B, H, S, D]; SCALE: fp32 [B, H, S]. One program: BLOCK_S tokens of one (batch, head).
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    tokens = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    mask = tokens[:, None] < S
    x = tl.load(X + b.to(tl.int64) * stride_xb + h * stride_xh + tokens[:, None].to(tl.int64) * stride_xs + dims[None, :],
                mask=mask, other=0.0)
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
    mean = x.mean(dim=1, dtype=torch.float32).to(x.dtype) if smooth else x  # [B, H, D], as smooth_k; x: unread
    codes = torch.empty(b, h, s, d, dtype=torch.int8, device=x.device)
    scale = torch.empty(b, h, s, dtype=torch.float32, device=x.device)
    _quantize_qk_kernel[(triton.cdiv(s, block_s), b * h)](
        x, mean, codes, scale, s, h, x.stride(0), x.stride(1), x.stride(2), mean.stride(0), mean.stride(1),
        SMOOTH=smooth, D=d, BLOCK_S=block_s, num_warps=4)
    return codes, scale
