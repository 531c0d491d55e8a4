"""Activation quantizers of the FP8 GEMM paths as single Triton kernels (GPU; imported on first use).

Quantizing an activation for ``torch._scaled_mm`` costs a row amax, a scale and a cast. Run as
separate PyTorch ops (or as a torch.compile graph with dynamic shapes) that is several passes over
an activation as large as the GEMM's input, and it ate most of FP8's gain on the H200
(docs/PERFORMANCE.md#gemms-per-format: GEMM against end to end). Here a program owns whole rows
(``Tiling``): it finds each row's (or its MX blocks') amax, then writes the FP8 codes, holding the
rows in registers or reading them again.

The arithmetic is exactly ``linear.quantize_rowwise_fp8`` and ``linear.mx_repack_fp8`` (tested
equal, in Triton's CPU interpreter and on the GPU) at a few instructions per element: powers of
two are built from their bits, the element grid's round-half-to-even on the bits (and with the
1.5 * 2^k trick below the smallest normal), and each division by a row's scale is one multiply
and two multiply-adds that give the correctly rounded quotient (``_quotient``). NaN and infinite
inputs are not given the reference's special scales (activations are finite); the reference codec
is the one for them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ditrun.kernels import formats

ROUND_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2^23: adding and subtracting it rounds an fp32 of magnitude < 2^22 to an integer, half to even."""
GELU_TANH_COEFF = tl.constexpr(0.044715)
TWO_SQRT_2_OVER_PI = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))
GELU_BOUND = tl.constexpr(0.25)
"""Above every |GELU(x)| of negative x (at most 0.1701 at x = -0.7518, BF16 rounding included)."""


@triton.jit
def _pow2(e):
    """2^e as fp32 for integer e in [-252, 254], exactly (subnormal results included): two normal halves."""
    half = e // 2
    a = ((half + 127) << 23).to(tl.float32, bitcast=True)
    b = ((e - half + 127) << 23).to(tl.float32, bitcast=True)
    return a * b


@triton.jit
def _floor_log2(x):
    """floor(log2 x) of normal positive fp32 values from the exponent bits (0 and subnormals: -127)."""
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@dataclass(frozen=True)
class Tiling:
    """How ``rowwise_fp8`` and ``mx_repack_fp8`` walk the activation: ``rows`` rows per program, in tiles of
    ``tile`` columns on ``warps`` warps. ``one_tile``: the whole row is one tile (``tile`` at least K, a power of
    two) held in registers, so the activation is read once; otherwise the rows are read twice, tile by tile
    (amax, then codes), the second time mostly from L2."""

    rows: int
    tile: int
    warps: int
    one_tile: bool = False

    def __str__(self) -> str:
        return f"{'one tile' if self.one_tile else f'tiles of {self.tile}'} x {self.rows} rows, {self.warps} warps"


def default_tiling(k: int, kernel: str = "fp8") -> Tiling:
    """The tiling ``kernel`` ("fp8": ``rowwise_fp8``; "mx": ``mx_repack_fp8``) uses for rows of ``k`` elements: the
    fastest, or within 3% of it, at M = 4608 and 20992 for each K of the Flux linears on one H200
    (``benchmarks/gemm.py --tilings``).

    FP8: rows of at most 4096 elements held in registers by 4 warps, longer ones read twice in tiles of 1024 on 8
    warps. MX: two rows per program read twice, in tiles of 1024 on 4 warps up to 4096 elements and of 2048 on 8
    warps where 2048 divides K; other rows up to 16384 elements held in registers by 8 warps (K = 15360: a ragged
    last tile cost more than the registers)."""
    whole = triton.next_power_of_2(k)
    if kernel == "fp8":
        return Tiling(rows=1, tile=whole, warps=4, one_tile=True) if whole <= 4096 else Tiling(1, 1024, 8)
    if whole <= 4096:
        return Tiling(rows=2, tile=1024, warps=4)
    if k % 2048 and whole <= 16384:
        return Tiling(rows=1, tile=whole, warps=8, one_tile=True)
    return Tiling(rows=2, tile=2048, warps=8)


def candidate_tilings(k: int) -> list[Tiling]:
    """Tilings worth timing for rows of ``k`` elements (``benchmarks/gemm.py --tilings``)."""
    looped = [Tiling(r, t, w) for r in (1, 2, 4) for t in (512, 1024, 2048) for w in (4, 8) if r * t <= 4096]
    whole = triton.next_power_of_2(k)
    held = [Tiling(r, whole, w, True) for r in (1, 2) for w in (4, 8, 16) if r * whole // (32 * w) <= 64]
    return looped + held


def _grid(rows: int, tiling: Tiling, k: int) -> tuple[int]:
    """The launch grid of ``tiling`` over ``rows`` rows of ``k`` elements."""
    if tiling.one_tile and tiling.tile < k:
        raise ValueError(f"a one-tile tiling needs tile >= K = {k}, got {tiling.tile}")
    return (triton.cdiv(rows, tiling.rows),)


@triton.jit
def _quotient(x, scale, recip):
    """x / scale rounded once (as ``torch.div`` and ``tl.math.div_rn``), from recip = 1 / scale rounded once: one
    multiply and two multiply-adds instead of a division per element. The remainder x - q scale of the first
    quotient q is exact in an fma, and q + remainder / scale rounded once is the correctly rounded quotient
    (Markstein's theorem, for a faithful q and a correctly rounded reciprocal; quotients below 2^-126, which
    are E4M3 zeros either way, aside)."""
    q = x * recip
    return tl.fma(tl.fma(-q, scale, x), recip, q)


@triton.jit
def _divisor(scale):
    """(lift, divisor, 1 / divisor) for dividing by ``scale``: a row of tiny values (scale < 2^-100) is divided with
    both operands times 2^64, exactly, so that the reciprocal and the remainder stay normal numbers."""
    lift = tl.where(scale < 7.888609052210118e-31, 1.8446744073709552e19, 1.0)
    divisor = scale * lift
    return lift, divisor, tl.math.div_rn(tl.full(divisor.shape, 1.0, tl.float32), divisor)


@triton.jit
def _fp8_codes(x, lift, divisor, recip, FP8_MAX: tl.constexpr):
    """x / scale (``_divisor``'s terms), clamped to +-FP8_MAX: the codes' values before the cast."""
    return tl.minimum(tl.maximum(_quotient(x * lift, divisor, recip), -FP8_MAX), FP8_MAX)


@triton.jit
def _rounded_to(x, DTYPE: tl.constexpr, ON_BITS: tl.constexpr):
    """fp32 x rounded to DTYPE (nearest, ties to even), as fp32. ``ON_BITS``: BF16 rounding on the bits (finite x),
    for Triton's CPU interpreter, whose BF16 cast truncates where GPUs round."""
    if ON_BITS and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _activated(x, ACTIVATION: tl.constexpr, DTYPE: tl.constexpr, ON_BITS: tl.constexpr):
    """x (fp32, loaded from DTYPE) through the MLP activation, rounded to DTYPE as the activation's output is:
    ``ACTIVATION`` 0 none, 1 GELU(tanh) written as x sigmoid(2u) (``model.dit.gelu_activation``'s compiled form).
    The quotient is the GPU's fast one (within 2 ulp of fp32, before the rounding to DTYPE): the kernel is bound by
    its arithmetic, and an IEEE division costs several times the rest of the activation."""
    if ACTIVATION == 1:
        u = x + x * GELU_TANH_COEFF * x * x  # the products in torch's order (c x) x x, tensor first
        e = tl.exp(-(u * TWO_SQRT_2_OVER_PI))
        x = _rounded_to(tl.fdiv(x, 1.0 + e, ieee_rounding=False), DTYPE, ON_BITS)  # x sigmoid(2 sqrt(2/pi) u)
    return x


@triton.jit
def _rowwise_fp8_kernel(
    X,
    Y,
    SCALE,
    PREFIX,
    R,
    K,
    P,
    stride_x,
    stride_y,
    stride_p,
    FP8_MAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ONE_TILE: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    # Row r of the quantized matrix is [PREFIX[r, :P] | activation(X[r, :K])] (P = 0 without a prefix). ONE_TILE:
    # the row held in registers, X's part in one tile of BLOCK_K and the prefix's in one of BLOCK_P; else both read
    # twice in tiles of BLOCK_K (amax, then codes).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < R
    xp = X + rows[:, None] * stride_x + cols[None, :]
    yp = Y + rows[:, None] * stride_y + cols[None, :]
    DTYPE: tl.constexpr = X.dtype.element_ty
    if ONE_TILE:
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = _activated(tl.load(xp, mask=mask, other=0.0).to(tl.float32), ACTIVATION, DTYPE, ON_BITS)
        amax = tl.max(tl.abs(x), 1)
        if HAS_PREFIX:
            pcols = tl.arange(0, BLOCK_P)
            pmask = row_ok[:, None] & (pcols < P)[None, :]
            pre = tl.load(PREFIX + rows[:, None] * stride_p + pcols[None, :], mask=pmask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(pre), 1))
    else:
        pp = PREFIX + rows[:, None] * stride_p + cols[None, :]
        top = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        if HAS_PREFIX:
            for start in range(0, P, BLOCK_K):
                tile = tl.load(pp + start, mask=row_ok[:, None] & (start + cols < P)[None, :], other=0.0)
                top = tl.maximum(top, tl.abs(tile.to(tl.float32)))
        if ACTIVATION == 1:
            # GELU rises with x above its minimum (about -0.17, at x = -0.75), and its rounding keeps the order: where
            # the activation of a row's largest x reaches GELU_BOUND, that is the row's amax, found with one max per
            # element instead of an activation per element; other rows (every x small) are activated to find it.
            high = tl.full([BLOCK_R, BLOCK_K], float("-inf"), tl.float32)
            for start in range(0, K, BLOCK_K):
                tile = tl.load(xp + start, mask=row_ok[:, None] & (start + cols < K)[None, :], other=float("-inf"))
                high = tl.maximum(high, tile.to(tl.float32))
            largest = _activated(tl.max(high, 1), ACTIVATION, DTYPE, ON_BITS)
            found = (largest >= GELU_BOUND) | (rows >= R)
            if tl.min(found.to(tl.int32), 0) == 0:
                exact = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
                for start in range(0, K, BLOCK_K):
                    tile = tl.load(xp + start, mask=row_ok[:, None] & (start + cols < K)[None, :], other=0.0)
                    exact = tl.maximum(exact, tl.abs(_activated(tile.to(tl.float32), ACTIVATION, DTYPE, ON_BITS)))
                largest = tl.where(found, largest, tl.max(exact, 1))
            amax = tl.maximum(tl.max(top, 1), largest)
        else:
            for start in range(0, K, BLOCK_K):
                tile = tl.load(xp + start, mask=row_ok[:, None] & (start + cols < K)[None, :], other=0.0)
                top = tl.maximum(top, tl.abs(_activated(tile.to(tl.float32), ACTIVATION, DTYPE, ON_BITS)))
            amax = tl.max(top, 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
    tl.store(SCALE + rows, scale, mask=row_ok)
    lift, divisor, recip = _divisor(scale[:, None])
    if ONE_TILE:
        tl.store(yp + P, _fp8_codes(x, lift, divisor, recip, FP8_MAX).to(Y.dtype.element_ty), mask=mask)
        if HAS_PREFIX:
            codes = _fp8_codes(pre, lift, divisor, recip, FP8_MAX).to(Y.dtype.element_ty)
            tl.store(Y + rows[:, None] * stride_y + pcols[None, :], codes, mask=pmask)
    else:
        if HAS_PREFIX:
            for start in range(0, P, BLOCK_K):
                mask = row_ok[:, None] & (start + cols < P)[None, :]
                x = tl.load(pp + start, mask=mask, other=0.0).to(tl.float32)
                tl.store(yp + start, _fp8_codes(x, lift, divisor, recip, FP8_MAX).to(Y.dtype.element_ty), mask=mask)
        for start in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (start + cols < K)[None, :]
            x = _activated(tl.load(xp + start, mask=mask, other=0.0).to(tl.float32), ACTIVATION, DTYPE, ON_BITS)
            codes = _fp8_codes(x, lift, divisor, recip, FP8_MAX).to(Y.dtype.element_ty)
            tl.store(yp + P + start, codes, mask=mask)


ACTIVATIONS = {None: 0, "gelu_tanh": 1}
"""The activations ``rowwise_fp8`` applies before quantizing, by the name ``mx_gemm_triton.ACTIVATIONS`` uses."""


def joined_tiling(k: int) -> Tiling:
    """The tiling of ``rowwise_fp8`` with an activation or a prefix: rows read twice in tiles of 2048 on 8 warps (the
    first read finds a GELU row's amax from its largest x, the second computes the activation and the codes). The
    fastest of the tilings ``benchmarks/gemm.py --joined`` times at 20992 x 12288 on one H100 without the
    attention-output prefix, and within 5% of the fastest with it (docs/PROFILE.md); a whole row held in registers by
    16 or 32 warps ran slower."""
    return Tiling(rows=1, tile=min(2048, triton.next_power_of_2(k)), warps=8)


def rowwise_fp8(
    x: torch.Tensor,
    dtype: torch.dtype,
    store_dtype: torch.dtype | None = None,
    tiling: Tiling | None = None,
    activation: str | None = None,
    prefix: torch.Tensor | None = None,
):
    """x [R, K] -> (fp8 [R, K], fp32 scale [R, 1]): ``linear.quantize_rowwise_fp8`` in one kernel, bit for bit.

    ``activation`` (a name in ``ACTIVATIONS``) and ``prefix`` [R, P]: the rows quantized are
    [prefix | activation(x)] -> fp8 [R, P + K], the activation computed in fp32 and rounded to x's dtype, as the
    activation's output would be; neither is ever written in x's dtype. Rows may be strided (the last dim
    contiguous), as a split of a stacked projection's output is.
    ``store_dtype=torch.float32`` returns the values before the cast to ``dtype`` (the CPU interpreter's
    FP8 casts are not exact, so the tests check the arithmetic that way there and the cast on GPUs).
    ``tiling``: ``default_tiling(K, "fp8")`` unless given (``joined_tiling(K)`` with an activation or a prefix).
    """
    rows, k = x.shape
    width = k if prefix is None else prefix.shape[1] + k
    for name, t in (("x", x), ("prefix", prefix)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"rowwise_fp8: {name}'s last dim must be contiguous, got strides {t.stride()}")
    y = torch.empty(rows, width, dtype=store_dtype or dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    joined = activation is not None or prefix is not None
    t = tiling or (joined_tiling(k) if joined else default_tiling(k, "fp8"))
    _rowwise_fp8_kernel[_grid(rows, t, k)](
        x,
        y,
        scale,
        x if prefix is None else prefix,
        rows,
        k,
        0 if prefix is None else prefix.shape[1],
        x.stride(0),
        y.stride(0),
        0 if prefix is None else prefix.stride(0),
        FP8_MAX=torch.finfo(dtype).max,
        BLOCK_R=t.rows,
        BLOCK_K=t.tile,
        BLOCK_P=1 if prefix is None else triton.next_power_of_2(prefix.shape[1]),
        ONE_TILE=t.one_tile,
        HAS_PREFIX=prefix is not None,
        ACTIVATION=ACTIVATIONS[activation],
        ON_BITS=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=t.warps,
    )
    return y, scale


@triton.jit
def _shared_exponent(amax, EMAX: tl.constexpr, TOP_MANTISSA: tl.constexpr, RCEIL: tl.constexpr):
    """Each block's shared exponent from its amax (``formats.shared_exponents``, finite amax)."""
    exponent = _floor_log2(amax) - EMAX
    if RCEIL:
        # amax > max_elem * 2^exponent  <=>  amax's significand (in [1, 2)) > max_elem / 2^emax
        significand = ((amax.to(tl.int32, bitcast=True) & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
        exponent += (significand > TOP_MANTISSA).to(tl.int32)
    exponent = tl.where(amax == 0, -127, exponent)
    return tl.minimum(tl.maximum(exponent, -127), 127)


@triton.jit
def _round_to_grid(v, MBITS: tl.constexpr, MIN_EXP: tl.constexpr, ELEM_MAX: tl.constexpr, CLAMP: tl.constexpr):
    """``formats.round_to_grid``: v onto the element grid, half to even. The grid step in v's binade (never below the
    subnormals' 2^(MIN_EXP - MBITS)) is the last bit of 1.5 * 2^(23 + binade - MBITS): adding and subtracting that
    number rounds to it. ``CLAMP``: to +-ELEM_MAX (the floor scale rule lets a block's largest value exceed it)."""
    binade = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, MIN_EXP + 127)  # biased
    magic = (((binade + (23 - MBITS)) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (v + magic) - magic
    if CLAMP:
        rounded = tl.minimum(tl.maximum(rounded, -ELEM_MAX), ELEM_MAX)
    return rounded


@triton.jit
def _block_exponents(x, EMAX: tl.constexpr, TOP_MANTISSA: tl.constexpr, RCEIL: tl.constexpr):
    """x [rows, blocks, BLOCK] -> each block's shared exponent [rows, blocks]."""
    return _shared_exponent(tl.max(tl.abs(x), 2), EMAX, TOP_MANTISSA, RCEIL)


@triton.jit
def _mx_codes(
    x,
    exponent,
    row_exp,
    MBITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    ELEM_MAX: tl.constexpr,
    CLAMP: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """A tile's E4M3 values [rows, blocks, BLOCK] and whether each row has one that E4M3 cannot hold [rows].

    A grid value has at most 3 mantissa bits and the row scale keeps it at or below 448, so E4M3 holds it
    exactly from its smallest normal 2^-6 up; below, only multiples of its subnormal step 2^-9 (zero included).
    Grid values are multiples of 2^(MIN_EXP - MBITS), so a block shifted by 2^d with d >= -9 - MIN_EXP + MBITS
    is exact whatever its values: only a tile with a block shifted further checks its elements."""
    shift = tl.maximum(exponent - row_exp[:, None], -252)
    grid = _round_to_grid(x * _pow2(-exponent)[:, :, None], MBITS, MIN_EXP, ELEM_MAX, CLAMP)
    shifted = grid * _pow2(shift)[:, :, None]
    flags = tl.zeros(row_exp.shape, tl.int32)
    if tl.min(tl.min(shift, 1), 0) < -9 - MIN_EXP + MBITS:
        # shifted is E4M3-exact <=> shifted * 2^9 is an integer: from 2^-6 up, its last bit is worth 2^-9 or more
        steps = shifted * 512.0  # exact, and below 448 * 2^9 < 2^22 in magnitude
        flags = tl.max(tl.max((((steps + ROUND_MAGIC) - ROUND_MAGIC) != steps).to(tl.int32), 2), 1)
    return shifted.to(DTYPE), flags


@triton.jit
def _mx_repack_kernel(
    X,
    Y,
    SCALE,
    COUNT,
    R,
    K,
    stride_x,
    stride_y,
    EMAX: tl.constexpr,
    TOP_MANTISSA: tl.constexpr,
    RCEIL: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    ELEM_MAX: tl.constexpr,
    HEADROOM: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NB: tl.constexpr,
    ONE_TILE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    # A tile: NB MX blocks of BLOCK elements of each of the program's rows, as [BLOCK_R, NB, BLOCK].
    offsets = tl.arange(0, NB)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    xp = X + rows[:, None, None] * stride_x + offsets[None, :, :]
    yp = Y + rows[:, None, None] * stride_y + offsets[None, :, :]
    TILE: tl.constexpr = NB * BLOCK
    if ONE_TILE:
        mask = row_ok[:, None, None] & (offsets < K)[None, :, :]
        x = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        exponent = _block_exponents(x, EMAX, TOP_MANTISSA, RCEIL)
        top = tl.max(exponent, 1)
    else:
        top = tl.full([BLOCK_R, NB], -127, tl.int32)
        for start in range(0, K, TILE):
            tile = tl.load(xp + start, mask=row_ok[:, None, None] & (start + offsets < K)[None, :, :], other=0.0)
            top = tl.maximum(top, _block_exponents(tile.to(tl.float32), EMAX, TOP_MANTISSA, RCEIL))
        top = tl.max(top, 1)
    row_exp = top - HEADROOM
    tl.store(SCALE + rows, _pow2(row_exp), mask=row_ok)
    if ONE_TILE:
        y, inexact = _mx_codes(x, exponent, row_exp, MBITS, MIN_EXP, ELEM_MAX, not RCEIL, Y.dtype.element_ty)
        tl.store(yp, y, mask=mask)
    else:
        inexact = tl.zeros([BLOCK_R], tl.int32)
        for start in range(0, K, TILE):
            mask = row_ok[:, None, None] & (start + offsets < K)[None, :, :]
            x = tl.load(xp + start, mask=mask, other=0.0).to(tl.float32)
            exponent = _block_exponents(x, EMAX, TOP_MANTISSA, RCEIL)
            y, bad = _mx_codes(x, exponent, row_exp, MBITS, MIN_EXP, ELEM_MAX, not RCEIL, Y.dtype.element_ty)
            inexact |= bad
            tl.store(yp + start, y, mask=mask)
    # one atomic per inexact row (none in most programs), into the caller's running count
    tl.atomic_add(COUNT + rows * 0, inexact.to(tl.int64), mask=row_ok & (inexact > 0))


def mx_repack_fp8(
    x: torch.Tensor,
    element_name: str,
    block: int,
    scale_mode: str,
    headroom: int,
    store_dtype: torch.dtype = torch.float8_e4m3fn,
    tiling: Tiling | None = None,
    count: torch.Tensor | None = None,
):
    """``linear.mx_repack_fp8`` in one kernel, bit for bit: x [R, K] -> (E4M3 [R, K], fp32 2^e_row [R, 1],
    inexact rows: ``count`` with them added, a 0-dim int64 tensor, or a new one). ``store_dtype``: as in
    ``rowwise_fp8``; ``tiling``: ``default_tiling(K, "mx")`` unless given."""
    element = formats.element_format(element_name)
    rows, k = x.shape
    y = torch.empty(rows, k, dtype=store_dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    count = torch.zeros((), dtype=torch.int64, device=x.device) if count is None else count
    t = tiling or default_tiling(k, "mx")
    _mx_repack_kernel[_grid(rows, t, k)](
        x,
        y,
        scale,
        count,
        rows,
        k,
        x.stride(0),
        y.stride(0),
        EMAX=element.emax,
        TOP_MANTISSA=element.max_value / 2.0**element.emax,
        RCEIL=scale_mode == "rceil",
        MBITS=element.mantissa_bits,
        MIN_EXP=1 - element.bias,
        ELEM_MAX=element.max_value,
        HEADROOM=headroom,
        BLOCK=block,
        BLOCK_R=t.rows,
        NB=max(1, t.tile // block),
        ONE_TILE=t.one_tile,
        num_warps=t.warps,
    )
    return y, scale, count
