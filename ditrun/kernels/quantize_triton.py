"""Activation quantizers of the FP8 GEMM paths as single Triton kernels (GPU; imported on first use).

Quantizing an activation for ``torch._scaled_mm`` costs a row amax, a scale and a cast. Run as
separate PyTorch ops (or as a torch.compile graph with dynamic shapes) that is several passes over
an activation as large as the GEMM's input, and it ate most of FP8's gain on the H200
(docs/PERFORMANCE.md). Here one program owns one row: a first loop over K finds the row's (or its
MX blocks') amax, a second loop reads the row again (from L2) and writes the FP8 codes.

The arithmetic is exactly ``linear.quantize_rowwise_fp8`` and ``linear.mx_repack_fp8`` (tested
equal, in Triton's CPU interpreter and on the GPU): powers of two are built from their bits, the
element grid's round-half-to-even with the 1.5 * 2^23 trick (exact for the few-bit integers
it rounds), and every division is correctly rounded. NaN and infinite inputs are not given the
reference's special scales (activations are finite); the reference codec is the one for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditrun.kernels import formats

ROUND_MAGIC = tl.constexpr(12582912.0)
"""1.5 * 2^23: adding and subtracting it rounds an fp32 of magnitude < 2^22 to an integer, half to even."""


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


@triton.jit
def _rowwise_fp8_kernel(X, Y, SCALE, K, stride_x, stride_y, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        x = tl.load(X + row * stride_x + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, 0)
    scale = tl.where(top > 0, tl.math.div_rn(top, FP8_MAX), 1.0)
    tl.store(SCALE + row, scale)
    for start in range(0, K, BLOCK_K):
        x = tl.load(X + row * stride_x + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(Y + row * stride_y + start + cols, y.to(Y.dtype.element_ty), mask=start + cols < K)


def rowwise_fp8(x: torch.Tensor, dtype: torch.dtype, store_dtype: torch.dtype | None = None):
    """x [R, K] -> (fp8 [R, K], fp32 scale [R, 1]): ``linear.quantize_rowwise_fp8`` in one kernel.

    ``store_dtype=torch.float32`` returns the values before the cast to ``dtype`` (the CPU interpreter's
    FP8 casts are not exact, so the tests check the arithmetic that way there and the cast on GPUs).
    """
    rows, k = x.shape
    y = torch.empty(rows, k, dtype=store_dtype or dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _rowwise_fp8_kernel[(rows,)](x, y, scale, k, x.stride(0), y.stride(0), FP8_MAX=torch.finfo(dtype).max,
                                 BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=4)
    return y, scale


@triton.jit
def _block_exponents(x, EMAX: tl.constexpr, TOP_MANTISSA: tl.constexpr, RCEIL: tl.constexpr):
    """x [NB, BLOCK] fp32 -> each block's shared exponent [NB] (``formats.shared_exponents``, finite x)."""
    amax = tl.max(tl.abs(x), 1)
    log2 = _floor_log2(amax)
    exponent = log2 - EMAX
    if RCEIL:
        # amax > max_elem * 2^exponent  <=>  amax's significand (in [1, 2)) > max_elem / 2^emax
        significand = ((amax.to(tl.int32, bitcast=True) & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
        exponent += (significand > TOP_MANTISSA).to(tl.int32)
    exponent = tl.where(amax == 0, -127, exponent)
    return tl.minimum(tl.maximum(exponent, -127), 127)


@triton.jit
def _round_to_grid(v, MBITS: tl.constexpr, MIN_EXP: tl.constexpr, ELEM_MAX: tl.constexpr):
    """``formats.round_to_grid``: v onto the element grid (step 2^(binade - mantissa bits)), half to even."""
    step_exp = tl.maximum(_floor_log2(tl.abs(v)), MIN_EXP) - MBITS
    steps = v * _pow2(-step_exp)  # exact: a power of two
    rounded = (steps + ROUND_MAGIC) - ROUND_MAGIC
    return tl.minimum(tl.maximum(rounded * _pow2(step_exp), -ELEM_MAX), ELEM_MAX)


@triton.jit
def _mx_repack_kernel(X, Y, SCALE, INEXACT, K, stride_x, stride_y,
                      EMAX: tl.constexpr, TOP_MANTISSA: tl.constexpr, RCEIL: tl.constexpr, MBITS: tl.constexpr,
                      MIN_EXP: tl.constexpr, ELEM_MAX: tl.constexpr, HEADROOM: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # One tile = BLOCKS_PER_TILE MX blocks of BLOCK elements: [NB, BLOCK] offsets within the row.
    offsets = tl.arange(0, BLOCKS_PER_TILE)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    TILE = BLOCKS_PER_TILE * BLOCK
    top = tl.full([BLOCKS_PER_TILE], -127, tl.int32)
    for start in range(0, K, TILE):
        mask = start + offsets < K
        x = tl.load(X + row * stride_x + start + offsets, mask=mask, other=0.0).to(tl.float32)
        top = tl.maximum(top, _block_exponents(x, EMAX, TOP_MANTISSA, RCEIL))
    row_exp = tl.max(top, 0) - HEADROOM
    tl.store(SCALE + row, _pow2(row_exp))
    inexact = tl.zeros([BLOCKS_PER_TILE, BLOCK], tl.int32)
    for start in range(0, K, TILE):
        mask = start + offsets < K
        x = tl.load(X + row * stride_x + start + offsets, mask=mask, other=0.0).to(tl.float32)
        exponent = _block_exponents(x, EMAX, TOP_MANTISSA, RCEIL)[:, None]
        grid = _round_to_grid(x * _pow2(-exponent), MBITS, MIN_EXP, ELEM_MAX)
        shifted = grid * _pow2(tl.maximum(exponent - row_exp, -252))
        y = shifted.to(Y.dtype.element_ty)
        inexact |= (y.to(tl.float32) != shifted).to(tl.int32)
        tl.store(Y + row * stride_y + start + offsets, y, mask=mask)
    tl.atomic_add(INEXACT, (tl.max(tl.max(inexact, 1), 0)).to(tl.int64))


def mx_repack_fp8(x: torch.Tensor, element_name: str, block: int, scale_mode: str, headroom: int,
                  store_dtype: torch.dtype = torch.float8_e4m3fn):
    """``linear.mx_repack_fp8`` in one kernel: x [R, K] -> (E4M3 [R, K], fp32 2^e_row [R, 1], inexact rows).
    ``store_dtype``: as in ``rowwise_fp8``."""
    element = formats.element_format(element_name)
    rows, k = x.shape
    y = torch.empty(rows, k, dtype=store_dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    inexact = torch.zeros((), dtype=torch.int64, device=x.device)
    _mx_repack_kernel[(rows,)](
        x, y, scale, inexact, k, x.stride(0), y.stride(0),
        EMAX=element.emax, TOP_MANTISSA=element.max_value / 2.0**element.emax, RCEIL=scale_mode == "rceil",
        MBITS=element.mantissa_bits, MIN_EXP=1 - element.bias, ELEM_MAX=element.max_value, HEADROOM=headroom,
        BLOCK=block, BLOCKS_PER_TILE=max(1, min(32, triton.next_power_of_2(k // block))), num_warps=4)
    return y, scale, inexact


# ---------------------------------------------------------------------------------------------
# Activation + row-wise FP8 over the whole GPU (the MLPs' down-projection inputs)

BLOCK_ELEMENTS = 1024
"""Row elements per program of ``act_rowwise_fp8`` (4 warps; 4096 on 8 warps measured slower on one H200)."""


@triton.jit
def _gelu_tanh(x):
    """GELU, tanh approximation, in fp32: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def _act_chunk(A, B, row, chunk, KA, KB, stride_a, stride_b, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of the row [prefix A | act(B)] as fp32 values, the activation's rounded to B's dtype (as the
    reference's activation output is), and the columns it covers. Masked lanes load nothing."""
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    in_a = cols < KA
    a = tl.load(A + row * stride_a + cols, mask=in_a, other=0.0).to(tl.float32)
    b = tl.load(B + row * stride_b + cols - KA, mask=(cols >= KA) & (cols < KA + KB), other=0.0).to(tl.float32)
    if GELU:
        b = _gelu_tanh(b).to(B.dtype.element_ty).to(tl.float32)
    return tl.where(in_a, a, b), cols


@triton.jit
def _act_amax_kernel(A, B, PARTIAL, KA, KB, stride_a, stride_b, NCH, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    x, _ = _act_chunk(A, B, row, chunk, KA, KB, stride_a, stride_b, GELU, BLOCK)
    tl.store(PARTIAL + row * NCH + chunk, tl.max(tl.abs(x), 0))


@triton.jit
def _act_quantize_kernel(A, B, PARTIAL, Y, SCALE, KA, KB, stride_a, stride_b, stride_y, NCH,
                         FP8_MAX: tl.constexpr, GELU: tl.constexpr, BLOCK: tl.constexpr, NCH_P2: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    parts = tl.arange(0, NCH_P2)
    top = tl.max(tl.load(PARTIAL + row * NCH + parts, mask=parts < NCH, other=0.0), 0)
    scale = tl.where(top > 0, tl.math.div_rn(top, FP8_MAX), 1.0)
    if chunk == 0:
        tl.store(SCALE + row, scale)
    x, cols = _act_chunk(A, B, row, chunk, KA, KB, stride_a, stride_b, GELU, BLOCK)
    # times the reciprocal, not a correctly rounded division per element (which made the kernel compute-bound):
    # x / scale moves by at most an fp32 ulp, which changes an E4M3 code only next to a rounding boundary
    y = tl.minimum(tl.maximum(x * tl.math.div_rn(1.0, scale), -FP8_MAX), FP8_MAX)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=cols < KA + KB)


def act_rowwise_fp8(prefix: torch.Tensor | None, x: torch.Tensor, gelu: bool, dtype: torch.dtype,
                    store_dtype: torch.dtype | None = None, block: int = BLOCK_ELEMENTS):
    """[prefix | act(x)] [R, KA + KB] -> (fp8 [R, KA + KB], fp32 scale [R, 1]): ``linear.quantize_rowwise_fp8``
    of the activation's output (GELU-tanh rounded to x's dtype, or none) after the prefix, never written
    in x's dtype; the scales equal the reference's, the codes but for rare neighbours (see the kernel). Two
    passes over all of the GPU: per-chunk amaxes, then the codes (each a grid of rows x chunks, so that
    enough memory traffic is in flight; one program per row leaves HBM idle).
    ``prefix``: [R, KA] or None. ``store_dtype``: as in ``rowwise_fp8``."""
    rows, kb = x.shape
    ka = 0 if prefix is None else prefix.shape[1]
    a = x if prefix is None else prefix
    nch = triton.cdiv(ka + kb, block)
    partial = torch.empty(rows, nch, dtype=torch.float32, device=x.device)
    y = torch.empty(rows, ka + kb, dtype=store_dtype or dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    grid, warps = (rows, nch), max(4, min(8, block // 512))
    _act_amax_kernel[grid](a, x, partial, ka, kb, a.stride(0), x.stride(0), nch, GELU=gelu, BLOCK=block,
                           num_warps=warps)
    _act_quantize_kernel[grid](a, x, partial, y, scale, ka, kb, a.stride(0), x.stride(0), y.stride(0), nch,
                               FP8_MAX=torch.finfo(dtype).max, GELU=gelu, BLOCK=block,
                               NCH_P2=triton.next_power_of_2(nch), num_warps=warps)
    return y, scale
