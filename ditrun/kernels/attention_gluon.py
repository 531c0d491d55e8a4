"""INT8-QK flash attention for Hopper in Gluon (Triton's explicit-layout dialect): GPU only, sm_90, Triton 3.6.

The Triton kernel (``attention_triton.py``) leaves the tensor cores idle while a program computes its
softmax. This one is built the way Hopper attention kernels are:

- **Warp specialisation.** One warp streams K tiles (with their keys' scales) and V tiles into a ring of
  shared-memory stages with the tensor memory accelerator (TMA), signalling mbarriers. Two warpgroups of
  four warps each own 64 of the program's 128 query rows.
- **Ping-pong.** The two warpgroups take turns issuing their matrix products (an mbarrier pair), so one
  group's products run on the tensor cores while the other computes its softmax.
- **Both products of a step issued together.** Tile j's Q.K^T (INT8 ``wgmma`` into int32) and tile j-1's
  P @ V (BF16, P from registers) go out back to back; the softmax of tile j needs only Q.K^T (but see
  below).
- **Row sums on the tensor cores** (``rowsum_mma``): P @ ones, one more narrow product, instead of one fp32
  add per score (sums of P as rounded for P @ V).

Per score: the int32 sum to fp32 (``I2FP``), times the key's scale, the row max, one FMA for the exponent,
exp2, the BF16 pack. Q and K carry one scale per token (``kernels/attention.py`` says why), V is BF16 (or
FP8/MXFP6-exact values in BF16).

Measured on one H200 (docs/PERFORMANCE.md, 2026-11-30, session 3): 1.12-1.16x the Triton kernel's speed at
4608-20992 tokens, and 0.93x cuDNN's BF16 SDPA at 20992. It issues fewer instructions than cuDNN's kernel but
at a lower rate. What holds it back:
- a third of its stalls are at the 128-thread barrier Triton puts before each (single-thread) mbarrier
  arrive, three per step;
- ptxas places the wait for P @ V before the softmax, so a warpgroup's softmax overlaps only the other
  group's products, not its own;
- the per-token key scale costs a multiply per score.
``attention.int8qk_attention_op`` runs it on Hopper (``attention.GLUON_INT8QK``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
"""TMA tile load into shared memory: ``async_copy_global_to_shared`` in Triton 3.6, renamed ``async_load`` later."""

LOG2_E = 1.4426950408889634
GROUP_M = gl.constexpr(64)
"""Query rows per warpgroup (the M of one ``wgmma``); a program holds two groups."""
SUM_N = gl.constexpr(8)
"""Columns of the row-sum product P @ ones (the narrowest ``wgmma``)."""


@gluon.jit
def _load(q_desc, k_desc, ks_desc, v_desc, q_smem, k_smem, ks_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
          q_row, kv_row, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loading warp: the program's two Q tiles once, then K tiles (with their keys' scales) and V tiles
    through the stage ring."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    _tma_load(q_desc, [q_row + GROUP_M, 0], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        # A fresh barrier has completed "phase -1": the first pass through the ring does not wait.
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        _tma_load(ks_desc, [kv_row + j * BLOCK_N], k_ready.index(stage), ks_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        _tma_load(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _scores(acc_int, ks, start, S, q_scale, m_i, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, EVEN: gl.constexpr):
    """One tile's int32 Q.K sums and its keys' scales -> (P in fp32, the new row max, the old rows' rescale
    factor). Scores are in log2 units: q_scale holds sm_scale * log2(e)."""
    x = acc_int.to(gl.float32) * ks[None, :]
    if not EVEN:
        cols = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        x = gl.where((cols < S)[None, :], x, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(x, axis=1) * q_scale)  # q_scale > 0
    p = gl.exp2(x * q_scale[:, None] - m_new[:, None])
    return p, m_new, gl.exp2(m_i - m_new)


@gluon.jit
def _row_sums(p, l_acc, alpha, ones, l_layout: gl.constexpr, ROWSUM_MMA: gl.constexpr):
    """The running row sums with tile P added: issued as P @ ones (async) or added in fp32 at once."""
    if ROWSUM_MMA:
        l_new = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(0, l_layout, 2), assert_trivial=True),
                              ones.permute((1, 0)), l_acc, is_async=True)
    else:
        l_new = (l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
                 + gl.convert_layout(gl.sum(p, axis=1), gl.SliceLayout(1, l_layout))[:, None])
    return l_new


@gluon.jit
def _step(j, p, acc, l_acc, m_i, ones, q_tile, q_scale, k_smem, ks_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
          my_turn, their_turn, zero, S, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
          l_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EVEN: gl.constexpr,
          GROUP: gl.constexpr, ROWSUM_MMA: gl.constexpr):
    """Tile j's Q.K^T and tile j-1's P @ V (and P @ ones) issued together in this group's turn; tile j's softmax;
    then the output rescaled. -> (tile j's P, the output, the row sums, the row max)."""
    stage = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    mbarrier.wait(my_turn, (j & 1) ^ GROUP)  # group 0 goes first: its first wait passes on the fresh barrier
    qk = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
    pv = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
    if ROWSUM_MMA:
        l_acc = _row_sums(p, l_acc, None, ones, l_layout, True)
    mbarrier.arrive(their_turn, count=1)
    ks = ks_smem.index(stage).load(gl.SliceLayout(0, s_layout))
    qk = warpgroup_mma_wait(2 if ROWSUM_MMA else 1, deps=[qk])
    mbarrier.arrive(k_empty.index(stage), count=1)
    p_next, m_i, alpha = _scores(qk, ks, j * BLOCK_N, S, q_scale, m_i, s_layout, BLOCK_N, EVEN)
    if not ROWSUM_MMA:
        l_acc = _row_sums(p_next, l_acc, alpha, ones, l_layout, False)
    p_next = gl.convert_layout(p_next.to(p.dtype), p_layout)
    if ROWSUM_MMA:
        acc, l_acc, p = warpgroup_mma_wait(0, deps=[pv, l_acc, p])
        l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
    else:
        acc, p = warpgroup_mma_wait(0, deps=[pv, p])
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return p_next, acc, l_acc, m_i


@gluon.jit
def _last_pv(n_tiles, p, acc, l_acc, ones, v_smem, v_ready, v_empty, l_layout: gl.constexpr, STAGES: gl.constexpr,
             ROWSUM_MMA: gl.constexpr):
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    if ROWSUM_MMA:
        l_acc = _row_sums(p, l_acc, None, ones, l_layout, True)
        acc, l_acc, p = warpgroup_mma_wait(0, deps=[acc, l_acc, p])
    else:
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])
    mbarrier.arrive(v_empty.index(last), count=1)
    return acc, l_acc


@gluon.jit
def _attend(q_tile, k_smem, ks_smem, v_smem, ones, q_bar, k_ready, k_empty, v_ready, v_empty, my_turn, their_turn, QS,
            O, bh, S, row0, sm_scale_log2, n_tiles, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            EVEN: gl.constexpr, GROUP: gl.constexpr, ROWSUM_MMA: gl.constexpr):
    """One warpgroup: 64 query rows against every key tile; writes their output rows."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # Row sums as [64, SUM_N] (every column the same): the accumulators of P @ ones, or broadcast fp32 sums.
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, SUM_N, 16])

    rows = row0 + gl.arange(0, GROUP_M, layout=gl.SliceLayout(1, s_layout))
    q_scale = gl.load(QS + bh * S + rows, mask=rows < S, other=1.0) * sm_scale_log2
    zero = gl.zeros([GROUP_M, BLOCK_N], gl.int32, s_layout)
    acc = gl.zeros([GROUP_M, D], gl.float32, o_layout)
    l_acc = gl.zeros([GROUP_M, SUM_N], gl.float32, l_layout)
    m_i = gl.full([GROUP_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    qk = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    ks = ks_smem.index(0).load(gl.SliceLayout(0, s_layout))
    qk = warpgroup_mma_wait(0, deps=[qk])
    mbarrier.arrive(k_empty.index(0), count=1)
    p_a, m_i, alpha = _scores(qk, ks, 0, S, q_scale, m_i, s_layout, BLOCK_N, EVEN)
    if not ROWSUM_MMA:
        l_acc = _row_sums(p_a, l_acc, alpha, ones, l_layout, False)
    p_a = gl.convert_layout(p_a.to(v_smem.dtype), p_layout)
    # Two steps per trip, P alternating between two register sets: the next tile's P is written while the
    # current one is still an operand of the running P @ V.
    for j in range(1, n_tiles - 1, 2):
        p_b, acc, l_acc, m_i = _step(j, p_a, acc, l_acc, m_i, ones, q_tile, q_scale, k_smem, ks_smem, v_smem, k_ready,
                                     k_empty, v_ready, v_empty, my_turn, their_turn, zero, S, s_layout, o_layout,
                                     p_layout, l_layout, BLOCK_N, STAGES, EVEN, GROUP, ROWSUM_MMA)
        p_a, acc, l_acc, m_i = _step(j + 1, p_b, acc, l_acc, m_i, ones, q_tile, q_scale, k_smem, ks_smem, v_smem,
                                     k_ready, k_empty, v_ready, v_empty, my_turn, their_turn, zero, S, s_layout,
                                     o_layout, p_layout, l_layout, BLOCK_N, STAGES, EVEN, GROUP, ROWSUM_MMA)
    if n_tiles % 2 == 0:
        p_b, acc, l_acc, m_i = _step(n_tiles - 1, p_a, acc, l_acc, m_i, ones, q_tile, q_scale, k_smem, ks_smem, v_smem,
                                     k_ready, k_empty, v_ready, v_empty, my_turn, their_turn, zero, S, s_layout,
                                     o_layout, p_layout, l_layout, BLOCK_N, STAGES, EVEN, GROUP, ROWSUM_MMA)
        acc, l_acc = _last_pv(n_tiles, p_b, acc, l_acc, ones, v_smem, v_ready, v_empty, l_layout, STAGES, ROWSUM_MMA)
    else:
        acc, l_acc = _last_pv(n_tiles, p_a, acc, l_acc, ones, v_smem, v_ready, v_empty, l_layout, STAGES, ROWSUM_MMA)

    l_i = gl.max(l_acc, axis=1)
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    out_rows = row0 + gl.arange(0, GROUP_M, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    offsets = (bh * S + out_rows).to(gl.int64)[:, None] * D + dims[None, :]
    gl.store(O + offsets, out.to(v_smem.dtype), mask=(out_rows < S)[:, None])


@gluon.jit
def _int8qk_kernel(q_desc, k_desc, ks_desc, v_desc, QS, O, S, sm_scale_log2, D: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, EVEN: gl.constexpr, ROWSUM_MMA: gl.constexpr):
    # q, k: int8 [B * H * S, D]; v, O: [B * H * S, D] (BF16 or FP16); QS and the scales behind ks_desc: fp32
    # [B * H * S], one per token. Tiles past a head's S read the next head's rows: their scores are masked
    # (keys) or their rows not stored (queries); past the tensor TMA reads zeros.
    block_m = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = block_m * (2 * GROUP_M.value)
    n_tiles = gl.cdiv(S, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, GROUP_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [STAGES, BLOCK_N], ks_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    # The B operand of P @ ones, stored K-major ([SUM_N, BLOCK_N], read transposed) as K is.
    ones = gl.allocate_shared_memory(v_desc.dtype, [SUM_N, BLOCK_N],
                                     gl.NVMMASharedLayout.get_default_for([SUM_N, BLOCK_N], v_desc.dtype),
                                     gl.full([SUM_N, BLOCK_N], 1.0, v_desc.dtype,
                                             gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])))
    fence_async_shared()
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both warpgroups release a stage
        mbarrier.init(v_empty.index(i), count=2)

    gl.warp_specialize([
        (_attend, (q_smem.index(0), k_smem, ks_smem, v_smem, ones, q_bar, k_ready, k_empty, v_ready, v_empty,
                   turns.index(0), turns.index(1), QS, O, bh, S, row0, sm_scale_log2, n_tiles, D, BLOCK_N, STAGES, EVEN,
                   0, ROWSUM_MMA)),
        (_attend, (q_smem.index(1), k_smem, ks_smem, v_smem, ones, q_bar, k_ready, k_empty, v_ready, v_empty,
                   turns.index(1), turns.index(0), QS, O, bh, S, row0 + GROUP_M, sm_scale_log2, n_tiles, D, BLOCK_N,
                   STAGES, EVEN, 1, ROWSUM_MMA)),
        (_load, (q_desc, k_desc, ks_desc, v_desc, q_smem, k_smem, ks_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
                 v_empty, bh * S + row0, bh * S, n_tiles, BLOCK_N, STAGES)),
    ], [4, 1], [232, 24])


def _blocks(d: int, block_n: int, v_type) -> dict[str, tuple[list[int], gl.NVMMASharedLayout]]:
    """Each TMA operand's tile shape and shared-memory layout: Q, K and the keys' scales, V (of ``v_type``)."""
    shapes = {"q": ([GROUP_M.value, d], gl.int8), "k": ([block_n, d], gl.int8), "ks": ([block_n], gl.float32),
              "v": ([block_n, d], v_type)}
    return {name: (shape, gl.NVMMASharedLayout.get_default_for(shape, dtype))
            for name, (shape, dtype) in shapes.items()}


def int8qk_gluon(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor,
                 sm_scale: float, block_n: int = 128, stages: int = 3, rowsum_mma: bool = True) -> torch.Tensor:
    """INT8 q, k [B, H, S, D] with per-token fp32 scales [B, H, S], v [B, H, S, D] (BF16/FP16) -> [B, H, S, D]
    in v's dtype: the math of ``attention.int8qk_reference`` (P rounded to V's dtype for its products)."""
    b, h, s, d = q.shape
    rows = b * h * s
    q2, k2, v2 = (t.contiguous().view(rows, d) for t in (q, k, v))
    blocks = _blocks(d, block_n, gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16)
    q_desc, k_desc, ks_desc, v_desc = (TensorDescriptor.from_tensor(t, *blocks[name]) for name, t in (
        ("q", q2), ("k", k2), ("ks", k_scale.contiguous().view(rows)), ("v", v2)))
    out = torch.empty_like(v2)
    grid = (triton.cdiv(s, 2 * GROUP_M.value), b * h)
    _int8qk_kernel[grid](q_desc, k_desc, ks_desc, v_desc, q_scale.contiguous(), out, s, sm_scale * LOG2_E, D=d,
                         BLOCK_N=block_n, STAGES=stages, EVEN=s % block_n == 0, ROWSUM_MMA=rowsum_mma, num_warps=4)
    return out.view(b, h, s, d)


def compile_sm90(d: int = 128, block_n: int = 128, stages: int = 3, even: bool = True, rowsum_mma: bool = True):
    """The kernel compiled for sm_90 without a GPU (Triton's own ptxas): the ``CompiledKernel`` (its ``asm`` holds
    the PTX and the cubin) for BF16 V. For tests of a Triton version, and to read the SASS off any machine."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    blocks = _blocks(d, block_n, gl.bfloat16)
    element = {"q": "i8", "k": "i8", "ks": "fp32", "v": "bf16"}
    signature = {f"{name}_desc": f"tensordesc<{element[name]}{shape},{layout!r}>"
                 for name, (shape, layout) in blocks.items()}
    signature |= {"QS": "*fp32", "O": "*bf16", "S": "i32", "sm_scale_log2": "fp32", "D": "constexpr",
                  "BLOCK_N": "constexpr", "STAGES": "constexpr", "EVEN": "constexpr", "ROWSUM_MMA": "constexpr"}
    constants = {"D": d, "BLOCK_N": block_n, "STAGES": stages, "EVEN": even, "ROWSUM_MMA": rowsum_mma}
    source = GluonASTSource(_int8qk_kernel, signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
