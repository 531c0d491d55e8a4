"""INT8-QK flash attention for Hopper in Gluon (Triton's explicit-layout dialect): GPU only, sm_90, Triton 3.6.

The Triton kernel (``attention_triton.py``) leaves the tensor cores idle while a program computes its
softmax. This one is built the way Hopper attention kernels are:

- **Warp specialisation.** One warp streams K tiles (with their keys' scales) and V tiles into a ring of
  shared-memory stages (4) with the tensor memory accelerator (TMA), signalling mbarriers. Two warpgroups of
  four warps each own 64 of the program's 128 query rows. A stage (one tile's K and V) is released once, after
  its P @ V: Triton puts a warpgroup barrier before each single-thread mbarrier arrive and between an arrive and
  a later shared-memory read, so the kernel keeps arrives few and reads together (2 barriers per step).
- **The groups issue freely**: each warpgroup issues its products as soon as its operands are ready (taking
  turns, or one group starting a softmax later, measured slower).
- **Both products of a step issued together.** Tile j's Q.K^T (INT8 ``wgmma`` into int32) and tile j-1's
  P @ V (BF16, P from registers) go out back to back; the softmax of tile j needs only Q.K^T (but see
  below).
- **Row sums on the tensor cores**: P @ ones, one more narrow product, instead of one fp32
  add per score (sums of P as rounded for P @ V).

Per score: the int32 sum to fp32 (an integer add and an fp32 subtraction through the bits of 1.5 * 2^23:
exact, and 3-4% faster at 20992 tokens than ``I2FP``), times the key's scale, the row max, one FMA for the
exponent, exp2, the pack to the P @ V operand. Q and K carry one scale per token (``kernels/attention.py`` says
why), V is BF16 (or FP8/MXFP6-exact values in BF16).

- **FP8 P @ V** (``v_fp8``, for FP8 V): 2^8 P rounded to E4M3 in registers, V as E4M3 codes of V^T whose keys
  are stored in the order that makes the scores' registers the operand's (``_p_operand``, ``fp8_v_operand``);
  each tile's row sums start from zero and are added in fp32 (the FP8 products add at less than fp32
  precision). P is made the operand just before its product, so it never crosses the key loop as bytes.

Measured on one H200 against cuDNN's BF16 SDPA: docs/PERFORMANCE.md#attention-kernels. What holds it back
(Nsight Compute: no pipe above 45% busy, 0.65 eligible warps per scheduler, so latency):
- the softmax is about 9 instructions per score, 600 per step and warp (the conversion, the key scale, the max,
  the exponent, the pack, the output's rescale), and the two groups' warps share each scheduler;
- stalls at the 128-thread barriers Triton puts around mbarrier arrives and waits, 2 per step;
- the per-token key scale costs a multiply per score.
``attention.int8qk_attention_op`` runs it on Hopper where the model's build chose it (``attention.gluon_unavailable``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ditrun.kernels.attention_triton import INT_MAGIC, LOG2_E, ROUND_MAGIC, fp8_v_codes

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
"""TMA tile load into shared memory: ``async_copy_global_to_shared`` in Triton 3.6, renamed ``async_load`` later."""

GROUP_M = gl.constexpr(64)
"""Query rows per warpgroup (the M of one ``wgmma``); a program holds two groups."""
SUM_N = gl.constexpr(8)
"""Columns of the row-sum product P @ ones (the narrowest ``wgmma``)."""


@gluon.jit
def _load(
    q_desc,
    k_desc,
    ks_desc,
    v_desc,
    ones_desc,
    q_smem,
    k_smem,
    ks_smem,
    v_smem,
    ones,
    q_bar,
    k_ready,
    v_ready,
    empty,
    q_row,
    kv_row,
    ks_row,
    v_row,
    n_tiles,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    V_FP8: gl.constexpr,
):
    """The loading warp: the program's two Q tiles and the ones tile once, then K tiles (with their keys' scales,
    from element ``ks_row``) and V tiles through the stage ring (FP8 V: tiles of V^T, [D, BLOCK_N] from row
    ``v_row``). A stage holds one tile's K and V and is released once, when both groups are done with its V (its K
    was done before)."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + ones_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    _tma_load(q_desc, [q_row + GROUP_M, 0], q_bar, q_smem.index(1))
    _tma_load(ones_desc, [0, 0], q_bar, ones)
    for j in range(n_tiles):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        # A fresh barrier has completed "phase -1": the first pass through the ring does not wait.
        mbarrier.wait(empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        _tma_load(ks_desc, [ks_row + j * BLOCK_N], k_ready.index(stage), ks_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        if V_FP8:
            _tma_load(v_desc, [v_row, j * BLOCK_N], v_ready.index(stage), v_smem.index(stage))
        else:
            _tma_load(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _scores(
    acc_int,
    ks,
    start,
    S,
    q_scale,
    m_i,
    s_layout: gl.constexpr,
    BLOCK_N: gl.constexpr,
    EVEN: gl.constexpr,
    P_LOG2: gl.constexpr,
):
    """One tile's int32 Q.K sums and its keys' scales -> (2^P_LOG2 P in fp32, the new row max, the old rows'
    rescale factor). Scores are in log2 units: q_scale holds sm_scale * log2(e)."""
    x = ((acc_int + INT_MAGIC).to(gl.float32, bitcast=True) - ROUND_MAGIC) * ks[None, :]  # int32 -> fp32, exact
    if not EVEN:
        cols = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        x = gl.where((cols < S)[None, :], x, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(x, axis=1) * q_scale)  # q_scale > 0
    p = gl.exp2(x * q_scale[:, None] - (m_new - P_LOG2)[:, None])
    return p, m_new, gl.exp2(m_i - m_new)


@gluon.jit
def _row_sums(p, l_acc, ones, lp_layout: gl.constexpr, FRESH: gl.constexpr = False):
    """The running row sums with tile P added, issued as P @ ones (async; ``lp_layout``: P as its A operand; FRESH:
    tile P's sums alone): sums of P as rounded for P @ V, on the tensor cores instead of one fp32 add per score."""
    return warpgroup_mma(
        gl.convert_layout(p, lp_layout, assert_trivial=True),
        ones.permute((1, 0)),
        l_acc,
        use_acc=not FRESH,
        is_async=True,
    )


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr, V_FP8: gl.constexpr):
    """P (fp32, in the scores' layout) -> the A operand of P @ V in registers, in ``dtype``. BF16: the scores'
    layout is the operand's. FP8: within each 32 keys the operand wants other keys in a thread's registers than
    the scores put there; the keys are taken in the order that makes the two layouts the same registers (no data
    moves), and V^T's keys are stored in that order (``fp8_v_operand``)."""
    if V_FP8:
        p = p.reshape([GROUP_M, BLOCK_N // 32, 2, 2, 4, 2])
        p = p.permute((0, 1, 2, 4, 3, 5))
        p = gl.convert_layout(p.reshape([GROUP_M, BLOCK_N]), p_layout, assert_trivial=True)
        # Four of a thread's consecutive operand elements (one row, four keys) into one register.
        return gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r",
            [p],
            gl.float8e4nv,
            is_pure=True,
            pack=4,
        )
    return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _v_tile(v_smem, stage, V_FP8: gl.constexpr):
    """Stage ``stage`` of V as the B operand [BLOCK_N, D] of P @ V (FP8: stored as V^T, keys contiguous)."""
    if V_FP8:
        tile = v_smem.index(stage).permute((1, 0))
    else:
        tile = v_smem.index(stage)
    return tile


@gluon.jit
def _issue(
    i,
    p,
    acc,
    l_acc,
    ones,
    q_tile,
    zero,
    k_smem,
    ks_smem,
    v_smem,
    k_ready,
    v_ready,
    s_layout: gl.constexpr,
    p_layout: gl.constexpr,
    lp_layout: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    V_FP8: gl.constexpr,
    NEXT_QK: gl.constexpr,
):
    """With NEXT_QK tile i+1's Q.K^T, then tile i's P @ V and P @ ones with tile i's P (fp32) made the operand,
    all asynchronous; P @ V adds into the output. The orders measured fastest differ: FP8 makes P the operand
    and reads tile i+1's key scales before any product (so the multiply after Q.K^T does not wait on them); BF16
    issues Q.K^T before making P the operand (it runs while the last exponentials finish) and reads the key
    scales after the products. All reads come before the one mbarrier arrive (Triton puts a warpgroup barrier
    between an arrive and a later shared-memory read). FP8 P @ ones starts from zero, the tile's own sums (added
    in fp32 by ``_merge``): the FP8 products add at less than fp32 precision, and the row sums, growing with
    every tile, lost 40% by 20992 keys. -> (Q.K^T (``zero`` without NEXT_QK), its keys' scales, the output, the
    row sums (FP8: the tile's), P as the operand)."""
    if V_FP8:
        p = _p_operand(p, ones.dtype, p_layout, BLOCK_N, V_FP8)
    stage = i % STAGES
    qk = zero
    ks = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(0, s_layout))
    if NEXT_QK:
        mbarrier.wait(k_ready.index((i + 1) % STAGES), ((i + 1) // STAGES) & 1)
        if V_FP8:
            ks = ks_smem.index((i + 1) % STAGES).load(gl.SliceLayout(0, s_layout))
    if V_FP8:
        mbarrier.wait(v_ready.index(stage), (i // STAGES) & 1)
    if NEXT_QK:
        qk = warpgroup_mma(q_tile, k_smem.index((i + 1) % STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)
    if not V_FP8:
        p = _p_operand(p, ones.dtype, p_layout, BLOCK_N, V_FP8)
        mbarrier.wait(v_ready.index(stage), (i // STAGES) & 1)
    acc = warpgroup_mma(p, _v_tile(v_smem, stage, V_FP8), acc, is_async=True)
    l_acc = _row_sums(p, gl.zeros_like(l_acc) if V_FP8 else l_acc, ones, lp_layout, V_FP8)
    if NEXT_QK and not V_FP8:
        ks = ks_smem.index((i + 1) % STAGES).load(gl.SliceLayout(0, s_layout))
    return qk, ks, acc, l_acc, p


@gluon.jit
def _pv_wait(acc, l_acc, p, pending: gl.constexpr, V_FP8: gl.constexpr):
    """Wait until at most ``pending`` products are running, keeping P's registers (BF16 only: Triton 3.6 has no
    8-bit dependencies; ptxas keeps FP8 P's registers itself). -> (the output, the row sums)."""
    if V_FP8:
        acc, l_acc = warpgroup_mma_wait(pending, deps=[acc, l_acc])
    else:
        acc, l_acc, p = warpgroup_mma_wait(pending, deps=[acc, l_acc, p])
    return acc, l_acc


@gluon.jit
def _merge(acc, l_acc, pv, l_tile, p_op, V_FP8: gl.constexpr):
    """Once tile i's P @ V and P @ ones are done: the output and row sums with tile i in (FP8: the tile's row
    sums added in fp32)."""
    pv, l_tile = _pv_wait(pv, l_tile, p_op, 0, V_FP8)
    l_acc = l_acc + l_tile if V_FP8 else l_tile
    return pv, l_acc


@gluon.jit
def _softmax(
    j,
    qk,
    ks,
    acc,
    l_acc,
    pv,
    l_tile,
    m_i,
    p_op,
    q_scale,
    empty,
    S,
    s_layout: gl.constexpr,
    o_layout: gl.constexpr,
    l_layout: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    EVEN: gl.constexpr,
    V_FP8: gl.constexpr,
    P_LOG2: gl.constexpr,
    FIRST: gl.constexpr,
):
    """Tile j's softmax once its Q.K^T is done (tile j-1's P @ V ``pv`` and P @ ones ``l_tile``, of operand
    ``p_op``, still running unless FIRST), then tile j-1 merged into the output and row sums once its products
    are done (its stage released), both rescaled to tile j's row max. ``ks``: tile j's key scales. -> (tile j's P
    in fp32, the output, the row sums, the row max)."""
    qk = warpgroup_mma_wait(0 if FIRST else 2, deps=[qk])
    p, m_i, alpha = _scores(qk, ks, j * BLOCK_N, S, q_scale, m_i, s_layout, BLOCK_N, EVEN, P_LOG2)
    if not FIRST:
        acc, l_acc = _merge(acc, l_acc, pv, l_tile, p_op, V_FP8)
        mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
    return p, acc, l_acc, m_i


@gluon.jit
def _attend(
    q_tile,
    k_smem,
    ks_smem,
    v_smem,
    ones,
    q_bar,
    k_ready,
    v_ready,
    empty,
    QS,
    VS,
    O,
    bh,
    S,
    row0,
    sm_scale_log2,
    n_tiles,
    D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    EVEN: gl.constexpr,
    V_FP8: gl.constexpr,
):
    """One warpgroup: 64 query rows against every key tile; writes their output rows.

    Trip j of the key loop issues tile j's Q.K^T with tile j-1's P @ V, then computes tile j's softmax. P
    crosses the loop in fp32 and is made the operand just before its product: FP8 P would otherwise cross as
    single bytes, to be packed again."""
    # The K of one P @ V instruction, the operand's elements per 32 bits, P's scale (FP8: 2^8 P, at most 256).
    PV_K: gl.constexpr = 32 if V_FP8 else 16
    P_WIDTH: gl.constexpr = 4 if V_FP8 else 2
    P_LOG2: gl.constexpr = 8.0 if V_FP8 else 0.0
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, PV_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=P_WIDTH)
    # Row sums as [64, SUM_N] (every column the same): the accumulators of P @ ones.
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUM_N, PV_K]
    )
    lp_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=P_WIDTH)

    rows = row0 + gl.arange(0, GROUP_M, layout=gl.SliceLayout(1, s_layout))
    q_scale = gl.load(QS + bh * S + rows, mask=rows < S, other=1.0) * sm_scale_log2
    zero = gl.zeros([GROUP_M, BLOCK_N], gl.int32, s_layout)
    acc = gl.zeros([GROUP_M, D], gl.float32, o_layout)
    l_acc = gl.zeros([GROUP_M, SUM_N], gl.float32, l_layout)
    m_i = gl.full([GROUP_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    ks = ks_smem.index(0).load(gl.SliceLayout(0, s_layout))
    qk = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    p, acc, l_acc, m_i = _softmax(
        0,
        qk,
        ks,
        acc,
        l_acc,
        acc,
        l_acc,
        m_i,
        zero,
        q_scale,
        empty,
        S,
        s_layout,
        o_layout,
        l_layout,
        BLOCK_N,
        STAGES,
        EVEN,
        V_FP8,
        P_LOG2,
        True,
    )
    for j in range(1, n_tiles):
        qk, ks, pv, l_tile, p_op = _issue(
            j - 1,
            p,
            acc,
            l_acc,
            ones,
            q_tile,
            zero,
            k_smem,
            ks_smem,
            v_smem,
            k_ready,
            v_ready,
            s_layout,
            p_layout,
            lp_layout,
            BLOCK_N,
            STAGES,
            V_FP8,
            True,
        )
        p, acc, l_acc, m_i = _softmax(
            j,
            qk,
            ks,
            acc,
            l_acc,
            pv,
            l_tile,
            m_i,
            p_op,
            q_scale,
            empty,
            S,
            s_layout,
            o_layout,
            l_layout,
            BLOCK_N,
            STAGES,
            EVEN,
            V_FP8,
            P_LOG2,
            False,
        )
    last = n_tiles - 1
    qk, ks, pv, l_tile, p_op = _issue(
        last,
        p,
        acc,
        l_acc,
        ones,
        q_tile,
        zero,
        k_smem,
        ks_smem,
        v_smem,
        k_ready,
        v_ready,
        s_layout,
        p_layout,
        lp_layout,
        BLOCK_N,
        STAGES,
        V_FP8,
        False,
    )
    acc, l_acc = _merge(acc, l_acc, pv, l_tile, p_op, V_FP8)
    mbarrier.arrive(empty.index(last % STAGES), count=1)

    l_i = gl.max(l_acc, axis=1)
    if V_FP8:
        l_i = l_i / gl.load(VS + bh)  # V's scale per head
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    out_rows = row0 + gl.arange(0, GROUP_M, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    offsets = (bh * S + out_rows).to(gl.int64)[:, None] * D + dims[None, :]
    gl.store(O + offsets, out.to(O.dtype.element_ty), mask=(out_rows < S)[:, None])


@gluon.jit
def _int8qk_kernel(
    q_desc,
    k_desc,
    ks_desc,
    v_desc,
    ones_desc,
    QS,
    VS,
    O,
    S,
    S_KS,
    sm_scale_log2,
    D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    EVEN: gl.constexpr,
    V_FP8: gl.constexpr,
):
    # q, k: int8 [B * H * S, D]; v, O: [B * H * S, D] (BF16 or FP16); QS: fp32 [B * H * S], one scale per token;
    # the key scales behind ks_desc: fp32 [B * H, S_KS], S rounded up to 4 (``_key_scales``). Tiles past a head's
    # S read the next head's rows: their scores are masked (keys) or their rows not stored (queries); past the
    # tensor TMA reads zeros. V_FP8: v holds E4M3 codes of
    # V^T, [B * H * D, S rounded up to 32] (``fp8_v_operand``), VS one fp32 scale per (batch, head).
    block_m = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = block_m * (2 * GROUP_M.value)
    n_tiles = gl.cdiv(S, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, GROUP_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [STAGES, BLOCK_N], ks_desc.layout)
    if V_FP8:
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, D, BLOCK_N], v_desc.layout)
    else:
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    # The B operand of P @ ones, stored K-major ([SUM_N, BLOCK_N], read transposed) as K is; loaded by TMA
    # (written from registers, Triton 3.6 gives an 8-bit tile that P @ ones does not read as ones).
    ones = gl.allocate_shared_memory(ones_desc.dtype, [SUM_N, BLOCK_N], ones_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both warpgroups release a stage

    gl.warp_specialize(
        [
            (
                _attend,
                (
                    q_smem.index(0),
                    k_smem,
                    ks_smem,
                    v_smem,
                    ones,
                    q_bar,
                    k_ready,
                    v_ready,
                    empty,
                    QS,
                    VS,
                    O,
                    bh,
                    S,
                    row0,
                    sm_scale_log2,
                    n_tiles,
                    D,
                    BLOCK_N,
                    STAGES,
                    EVEN,
                    V_FP8,
                ),
            ),
            (
                _attend,
                (
                    q_smem.index(1),
                    k_smem,
                    ks_smem,
                    v_smem,
                    ones,
                    q_bar,
                    k_ready,
                    v_ready,
                    empty,
                    QS,
                    VS,
                    O,
                    bh,
                    S,
                    row0 + GROUP_M,
                    sm_scale_log2,
                    n_tiles,
                    D,
                    BLOCK_N,
                    STAGES,
                    EVEN,
                    V_FP8,
                ),
            ),
            (
                _load,
                (
                    q_desc,
                    k_desc,
                    ks_desc,
                    v_desc,
                    ones_desc,
                    q_smem,
                    k_smem,
                    ks_smem,
                    v_smem,
                    ones,
                    q_bar,
                    k_ready,
                    v_ready,
                    empty,
                    bh * S + row0,
                    bh * S,
                    bh * S_KS,
                    bh * D,
                    n_tiles,
                    BLOCK_N,
                    STAGES,
                    V_FP8,
                ),
            ),
        ],
        [4, 1],
        [232 if V_FP8 else 240, 24],
    )  # the second group's registers: none spilled with these (Triton 3.6)


def _blocks(d: int, block_n: int, v_type) -> dict[str, tuple[list[int], gl.NVMMASharedLayout]]:
    """Each TMA operand's tile shape and shared-memory layout: Q, K and the keys' scales, V (of ``v_type``; E4M3:
    tiles of V^T), the ones of P @ ones (``v_type``)."""
    v_shape = [d, block_n] if v_type == gl.float8e4nv else [block_n, d]
    shapes = {
        "q": ([GROUP_M.value, d], gl.int8),
        "k": ([block_n, d], gl.int8),
        "ks": ([block_n], gl.float32),
        "v": (v_shape, v_type),
        "ones": ([SUM_N.value, block_n], v_type),
    }
    return {
        name: (shape, gl.NVMMASharedLayout.get_default_for(shape, dtype)) for name, (shape, dtype) in shapes.items()
    }


def fp8_v_operand(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V [B, H, S, D] (BF16/FP16) -> the FP8 P @ V's B operand: (E4M3 codes of ``attention.quantize_v(v, "fp8")``
    as V^T, [B * H * D, S rounded up to 32] (zeros past S), keys reordered within each 32; fp32 power-of-two scale
    per head [B * H]), by the Triton kernels of ``attention_triton.fp8_v_codes``.

    Within each 32 keys the codes are stored in the order ``_p_operand`` takes P's keys in: stored key
    16h + 4t + 2w + e is key 16h + 8w + 2t + e (h, w, e < 2, t < 4), the scores' column a thread holds in the
    register where the FP8 operand wants that position (``attention.fp8_v_codes``: the same in torch)."""
    return fp8_v_codes(v.transpose(1, 2))


def _key_scales(k_scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The keys' scales [B, H, S] as the flat TMA operand, each head's row padded to S rounded up to 4 (zeros past
    S; the keys there are masked), and that row length. A TMA tile must start at a 16-byte boundary: a head's
    scales at ``bh * S`` floats with S not a multiple of 4 would not, and the load there stops the kernel with an
    illegal instruction (seen on one H200 at every such S with more than one head)."""
    b, h, s = k_scale.shape
    padded = -(-s // 4) * 4
    if padded == s:
        return k_scale.contiguous().view(b * h * s), s
    return F.pad(k_scale.reshape(b * h, s), (0, padded - s)).view(b * h * padded), padded


@functools.cache
def _ones(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ones tile P @ ones reads (loaded by TMA), one per shape, dtype and device."""
    return torch.ones(rows, cols, device=device).to(dtype)


def int8qk_gluon(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    block_n: int = 128,
    stages: int = 4,
    v_fp8: bool = False,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """INT8 q, k [B, H, S, D] with per-token fp32 scales [B, H, S], v [B, H, S, D] (BF16/FP16) -> [B, H, S, D]
    in v's dtype: the math of ``attention.int8qk_emulation`` (P rounded to V's dtype for its products).
    ``v_fp8``: v holds FP8-exact values; P @ V runs as an FP8 product of 2^8 P rounded to E4M3 and V's codes
    (``fp8_v_operand``), the row sums add P as rounded. With ``v_scale``, v is ``fp8_v_operand``'s codes
    already, and the output BF16."""
    b, h, s, d = q.shape
    rows = b * h * s
    q2, k2 = (t.contiguous().view(rows, d) for t in (q, k))
    out_dtype = torch.bfloat16 if v_scale is not None else v.dtype
    if v_scale is not None:
        v2, v_type = v, gl.float8e4nv
    elif v_fp8:
        v2, v_scale = fp8_v_operand(v)
        v_type = gl.float8e4nv
    else:
        v2, v_scale = v.contiguous().view(rows, d), q_scale  # q_scale: an unread stand-in
        v_type = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16
    blocks = _blocks(d, block_n, v_type)
    ones = _ones(SUM_N.value, block_n, torch.float8_e4m3fn if v_type == gl.float8e4nv else v.dtype, q.device)
    ks, ks_row = _key_scales(k_scale)
    q_desc, k_desc, ks_desc, v_desc, ones_desc = (
        TensorDescriptor.from_tensor(t, *blocks[name])
        for name, t in (("q", q2), ("k", k2), ("ks", ks), ("v", v2), ("ones", ones))
    )
    out = torch.empty((b, h, s, d), dtype=out_dtype, device=q.device)
    grid = (triton.cdiv(s, 2 * GROUP_M.value), b * h)
    _int8qk_kernel[grid](
        q_desc,
        k_desc,
        ks_desc,
        v_desc,
        ones_desc,
        q_scale.contiguous(),
        v_scale,
        out,
        s,
        ks_row,
        sm_scale * LOG2_E,
        D=d,
        BLOCK_N=block_n,
        STAGES=stages,
        EVEN=s % block_n == 0,
        V_FP8=v_type == gl.float8e4nv,
        num_warps=4,
    )
    return out
