"""The Triton flash-attention kernel of INT8-QK attention (GPU only; imported on first use).

One program per (block of BLOCK_Q queries, batch x head): the INT8 Q tile stays in registers,
K/V tiles of BLOCK_K tokens stream through; Q.K^T is an INT8 tensor-core dot (int32, exact),
scaled by the two per-block scales, and an online softmax in fp32 (base 2) accumulates P @ V
with P cast to V's dtype. Q and K carry one scale per token: a tile's scores are scaled by the
outer product of two scale vectors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.autotune(
    configs=[triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)],
    key=["S", "D"],
)
@triton.jit
def _int8qk_forward(Q, QS, K, KS, V, O, sm_scale_log2, S, H, stride_b, stride_h, stride_s, scale_b, scale_h,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    block_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    base = b * stride_b + h * stride_h
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    q = tl.load(Q + base + rows[:, None] * stride_s + dims[None, :], mask=rows[:, None] < S, other=0)
    scales = b * scale_b + h * scale_h
    q_scale = tl.load(QS + scales + rows, mask=rows < S, other=0.0) * sm_scale_log2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, S, BLOCK_N):
        keys = start + cols
        k = tl.load(K + base + keys[None, :] * stride_s + dims[:, None], mask=keys[None, :] < S, other=0)
        k_scale = tl.load(KS + scales + keys, mask=keys < S, other=0.0)
        scores = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32) * (q_scale[:, None] * k_scale[None, :])  # log2 units
        scores = tl.where(keys[None, :] < S, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + base + keys[:, None] * stride_s + dims[None, :], mask=keys[:, None] < S, other=0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + base + rows[:, None] * stride_s + dims[None, :], out.to(O.dtype.element_ty), mask=rows[:, None] < S)


def int8qk_flash(ops, sm_scale: float, block_q: int, block_k: int) -> torch.Tensor:
    """ops: ``Int8QK`` with contiguous [B, H, S, D] q, k (int8), v -> [B, H, S, D] in v's dtype."""
    q, k, v = ops.q.contiguous(), ops.k.contiguous(), ops.v.contiguous()
    q_scale, k_scale = ops.q_scale.contiguous(), ops.k_scale.contiguous()
    b, h, s, d = q.shape
    out = torch.empty_like(v)
    grid = (triton.cdiv(s, block_q), b * h)
    _int8qk_forward[grid](q, q_scale, k, k_scale, v, out, sm_scale * LOG2_E, s, h,
                          q.stride(0), q.stride(1), q.stride(2), q_scale.stride(0), q_scale.stride(1),
                          BLOCK_M=block_q, BLOCK_N=block_k, D=d)
    return out
