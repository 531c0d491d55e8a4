"""ditrun's MX GEMM: MXFP8, MXFP6 (E2M3, E3M2) and MXFP4 operands with E8M0 block scales in one Triton kernel
(GPU; imported on first use), for gfx950 (MI355X), whose scaled MFMA (``v_mfma_scale_f32_*_f8f6f4``) multiplies
blocks of 32 elements under their E8M0 scales at four times the BF16 rate.

Both operands arrive as ``formats.quantize_mx`` leaves them: packed codes [rows, K * bits / 8] (uint8) and E8M0
scales [rows, K / 32]; the activation is A [M, ...], the weight B [N, ...] (K-major, as a linear keeps it). Each
program computes a BLOCK_M x BLOCK_N tile of A B^T with ``tl.dot_scaled``, one K tile at a time, accumulating in
fp32.

Triton 3.9's ``tl.dot_scaled`` takes E4M3, E5M2 and E2M1 operands, not the FP6 formats ("NYI: lhs_format e2m3").
MXFP6 is read from memory packed at 6 bits (four codes in three bytes: the memory traffic of FP6) and carried into
the scaled MFMA as E4M3 codes: every E2M3 and E3M2 value is an E4M3 value (at most 3 mantissa bits; magnitudes from
2^-4 to 28, normal in E4M3), so the product is exact and the scales are the same. What that costs against native
FP6: a few integer instructions per element to unpack and re-encode, and the MFMA at FP8's rate, which on MI355X
is half the FP6/FP4 rate.

Around the GEMM, the same module holds what ``linear.MxTriton`` fuses: ``mx_quantize`` (an activation to packed
codes and E8M0 scales in one pass, as ``formats.quantize_mx``) and ``mx_gemm_act`` (an MLP's up projection whose
epilogue adds the bias, applies GELU(tanh) or SwiGLU and quantizes the result in registers into the down
projection's operand, so the hidden state is never written).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ditrun.kernels import formats

ELEMENTS = {"fp8_e4m3": 0, "fp6_e2m3": 1, "fp6_e3m2": 2, "fp4_e2m1": 3}
"""The element formats the kernel reads (the ``ELEMENT`` constexpr)."""
BLOCK = 32
"""Elements per E8M0 scale (OCP MX v1.0): fixed by the scaled MFMA."""


@triton.jit
def _fp6_as_e4m3(code, EBITS: tl.constexpr, MBITS: tl.constexpr):
    """6-bit codes (int32) of E2M3 (EBITS 2, MBITS 3) or E3M2 -> the E4M3 codes (uint8) of the same values, exactly:
    the value through fp32 (significand times a power of two), whose bits give E4M3's exponent and mantissa."""
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    exponent = (code >> MBITS) & ((1 << EBITS) - 1)
    mantissa = code & ((1 << MBITS) - 1)
    significand = tl.where(exponent > 0, mantissa + (1 << MBITS), mantissa)  # subnormals: no implicit bit
    power = ((tl.maximum(exponent, 1) - BIAS - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    bits = (significand.to(tl.float32) * power).to(tl.int32, bitcast=True)  # exact: few significant bits
    e4m3 = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 0x7)  # rebias 127 -> 7, top 3 mantissa bits
    e4m3 = tl.where(significand == 0, 0, e4m3) | ((code >> 5) << 7)  # zero, then the sign
    return e4m3.to(tl.uint8)


@triton.jit
def _unpack_fp6(P, rows, k_tile, row_ok, stride, K, EBITS: tl.constexpr, MBITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_K FP6 codes of each row from packed bytes (``formats.pack``: c0 | c1 << 6 | c2 << 12 | c3 << 18 in
    three bytes, little-endian) -> their E4M3 codes [rows, BLOCK_K] as fp8e4nv."""
    quads = k_tile // 4 + tl.arange(0, BLOCK_K // 4)  # groups of four codes
    mask = row_ok[:, None] & (quads * 4 < K)[None, :]
    at = P + rows[:, None] * stride + 3 * quads[None, :]
    word = tl.load(at, mask=mask, other=0).to(tl.int32)
    word |= tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8
    word |= tl.load(at + 2, mask=mask, other=0).to(tl.int32) << 16
    c0, c1 = _fp6_as_e4m3(word & 0x3F, EBITS, MBITS), _fp6_as_e4m3((word >> 6) & 0x3F, EBITS, MBITS)
    c2, c3 = _fp6_as_e4m3((word >> 12) & 0x3F, EBITS, MBITS), _fp6_as_e4m3((word >> 18) & 0x3F, EBITS, MBITS)
    # join(join(c0, c2), join(c1, c3))[..., a, b] is code 2a + b of each group: flattened, the codes in K order
    codes = tl.join(tl.join(c0, c2), tl.join(c1, c3)).reshape(c0.shape[0], BLOCK_K)
    return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _operand(P, rows, k_tile, row_ok, stride, K, ELEMENT: tl.constexpr, BLOCK_K: tl.constexpr):
    """One operand's K tile as ``tl.dot_scaled`` takes it: E4M3 [rows, BLOCK_K] (MXFP8; MXFP6 re-encoded) or E2M1
    pairs packed in bytes [rows, BLOCK_K / 2] (MXFP4)."""
    if ELEMENT == 0:
        cols = k_tile + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        return tl.load(P + rows[:, None] * stride + cols[None, :], mask=mask, other=0).to(tl.float8e4nv, bitcast=True)
    elif ELEMENT == 1:
        return _unpack_fp6(P, rows, k_tile, row_ok, stride, K, 2, 3, BLOCK_K)
    elif ELEMENT == 2:
        return _unpack_fp6(P, rows, k_tile, row_ok, stride, K, 3, 2, BLOCK_K)
    else:
        pairs = k_tile // 2 + tl.arange(0, BLOCK_K // 2)
        mask = row_ok[:, None] & (pairs * 2 < K)[None, :]
        return tl.load(P + rows[:, None] * stride + pairs[None, :], mask=mask, other=0)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns of an [M, N] output, and which of them are inside it."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def _mx_product(
    A, A_SCALE, B, B_SCALE, rows, cols, row_ok, col_ok, K, stride_a, stride_as, stride_b, stride_bs,
    ELEMENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The fp32 tile [BLOCK_M, BLOCK_N] of A B^T at ``rows`` of A and ``cols`` (rows of B), one K tile at a time."""
    FORMAT: tl.constexpr = "e2m1" if ELEMENT == 3 else "e4m3"
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_tile in range(0, K, BLOCK_K):
        a = _operand(A, rows, k_tile, row_ok, stride_a, K, ELEMENT, BLOCK_K)
        b = _operand(B, cols, k_tile, col_ok, stride_b, K, ELEMENT, BLOCK_K)
        blocks = k_tile // 32 + tl.arange(0, BLOCK_K // 32)
        block_ok = (blocks * 32 < K)[None, :]
        # past K: codes 0 (zeros in every format) under scale 2^0
        a_scale = tl.load(
            A_SCALE + rows[:, None] * stride_as + blocks[None, :], mask=row_ok[:, None] & block_ok, other=127
        )
        b_scale = tl.load(
            B_SCALE + cols[:, None] * stride_bs + blocks[None, :], mask=col_ok[:, None] & block_ok, other=127
        )
        acc = tl.dot_scaled(a, a_scale, FORMAT, tl.trans(b), b_scale, FORMAT, acc)
    return acc


@triton.jit
def _mx_gemm_kernel(
    A,
    A_SCALE,
    B,
    B_SCALE,
    C,
    M,
    N,
    K,
    stride_a,
    stride_as,
    stride_b,
    stride_bs,
    stride_c,
    ELEMENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # A: packed codes [M, K * bits / 8], A_SCALE: E8M0 [M, K / 32]; B, B_SCALE: the same for [N, K]; C: [M, N].
    rows, cols, row_ok, col_ok = _tile(M, N, BLOCK_M, BLOCK_N)
    acc = _mx_product(
        A, A_SCALE, B, B_SCALE, rows, cols, row_ok, col_ok, K, stride_a, stride_as, stride_b, stride_bs,
        ELEMENT, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    out = C + rows[:, None] * stride_c + cols[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


DEFAULT_TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
"""The tile the kernel runs with (and the compile tier builds): not yet timed on gfx950, which no one here has."""


def mx_gemm(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    element: str,
    out_dtype: torch.dtype,
    tiles: dict | None = None,
) -> torch.Tensor:
    """(A codes, A scales) [M, K] times (B codes, B scales) [N, K] transposed -> [M, N] in ``out_dtype``: the product
    of ``formats.dequantize_mx`` of each, accumulated in fp32. Codes packed and scales E8M0 as
    ``formats.quantize_mx`` returns them (``element``: one of ``ELEMENTS``; blocks of 32 along K)."""
    if element not in ELEMENTS:
        raise ValueError(f"element={element!r}; the MX GEMM reads {', '.join(ELEMENTS)}")
    m, n, k = a_codes.shape[0], b_codes.shape[0], a_scales.shape[1] * BLOCK
    bits = formats.element_format(element).bits
    if a_codes.shape[1] * 8 != k * bits or b_codes.shape[1] * 8 != k * bits or b_scales.shape[1] != a_scales.shape[1]:
        raise ValueError(f"codes {tuple(a_codes.shape)}, {tuple(b_codes.shape)} do not hold K = {k} {element} codes")
    a_codes, a_scales, b_codes, b_scales = (t.contiguous() for t in (a_codes, a_scales, b_codes, b_scales))
    c = torch.empty(m, n, dtype=out_dtype, device=a_codes.device)
    t = {**DEFAULT_TILES, **(tiles or {})}
    grid = (triton.cdiv(m, t["BLOCK_M"]), triton.cdiv(n, t["BLOCK_N"]))
    _mx_gemm_kernel[grid](
        a_codes,
        a_scales,
        b_codes,
        b_scales,
        c,
        m,
        n,
        k,
        a_codes.stride(0),
        a_scales.stride(0),
        b_codes.stride(0),
        b_scales.stride(0),
        c.stride(0),
        ELEMENT=ELEMENTS[element],
        **t,
    )
    return c


# ---------------------------------------------------------------------------------------------
# MX quantization in Triton: the activation quantizer and the fused MLP's epilogue


def element_constants(element: str) -> dict[str, float | int]:
    """The constexprs ``_mx_codes`` takes for ``element``, from its codec (``formats.FORMATS``)."""
    fmt = formats.element_format(element)
    return {
        "EBITS": fmt.exponent_bits,
        "MBITS": fmt.mantissa_bits,
        "EMAX": fmt.emax,
        "ELEM_MAX": fmt.max_value,
        "MAX_CODE": len(fmt.finite) - 1,  # codes are ordered by value: the largest finite one saturates
    }


@triton.jit
def _pow2(n):
    """2^n (int32 n in [-126, 127]) as fp32, exactly."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _floor_log2(x):
    """floor(log2 x) of fp32 x > 0, exactly, subnormals included (scaled by 2^64 first); x = 0 gives -191."""
    small = x < 1e-30
    bits = tl.where(small, x * 18446744073709551616.0, x).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 - tl.where(small, 64, 0)


@triton.jit
def _mx_codes(
    v, EBITS: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr, ELEM_MAX: tl.constexpr,
    MAX_CODE: tl.constexpr, RCEIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """fp32 tile [BLOCK_M, BLOCK_N] -> its MX codes (int32, unpacked) and the E8M0 scale of each block of 32 along
    N (int32 [BLOCK_M, BLOCK_N / 32]), as ``formats.quantize_mx`` computes them from the same fp32 values: the scale
    from the block's amax (``shared_exponents``), then each value over it rounded to the nearest grid point, ties
    to the even code, saturating (``encode``). Finite values: the fused GEMM's and the activations' are."""
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    amax = tl.max(tl.reshape(tl.abs(v), [BLOCK_M, BLOCK_N // 32, 32]), axis=2)
    exponent = _floor_log2(amax) - EMAX
    if RCEIL:  # round amax / ELEM_MAX up to a power of two: amax / 2^exponent is in [2^EMAX, 2^(EMAX + 1))
        half = exponent // 2
        exponent += (amax * _pow2(-half) * _pow2(half - exponent) > ELEM_MAX).to(tl.int32)
    exponent = tl.minimum(tl.maximum(tl.where(amax == 0, -127, exponent), -127), 127)
    shift = -exponent[:, :, None]  # in [-127, 127]: two exact factors
    half = shift // 2
    blocks = tl.reshape(v, [BLOCK_M, BLOCK_N // 32, 32]) * _pow2(half) * _pow2(shift - half)
    y = tl.reshape(blocks, [BLOCK_M, BLOCK_N])
    magnitude = tl.abs(y)
    binade = tl.maximum(_floor_log2(magnitude), 1 - BIAS)  # subnormals share the lowest binade's step
    steps = magnitude * _pow2(MBITS - binade)  # exact: a power of two, at most 2^(MBITS + 2)
    steps = (steps + 12582912.0) - 12582912.0  # round half to even (1.5 * 2^23: fp32's integer spacing is 1)
    # binade b, s steps of 2^(b - MBITS): code (b + BIAS - 1) * 2^MBITS + s, also where s carries into 2^(MBITS + 1)
    code = tl.minimum(((binade + BIAS - 1) << MBITS) + steps.to(tl.int32), MAX_CODE)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1  # -0.0 keeps its sign, as encode's signbit
    return code | (sign << (EBITS + MBITS)), exponent + 127


@triton.jit
def _store_mx(
    codes, scales, CODES, SCALES, rows, row_ok, col0, N, stride_c, stride_s,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Codes [BLOCK_M, BLOCK_N] (int32) of columns col0 (a multiple of 32) onward, packed as ``formats.pack`` (8
    bits: one a byte; 6: four in three bytes, c0 | c1 << 6 | c2 << 12 | c3 << 18 little-endian; 4: two a byte, the
    first low), and their E8M0 scales; columns from N on are not written."""
    blocks = col0 // 32 + tl.arange(0, BLOCK_N // 32)
    tl.store(SCALES + rows[:, None] * stride_s + blocks[None, :], scales.to(tl.uint8),
             mask=row_ok[:, None] & (blocks * 32 < N)[None, :])  # fmt: skip
    if BITS == 8:
        cols = col0 + tl.arange(0, BLOCK_N)
        at = CODES + rows[:, None] * stride_c + cols[None, :]
        tl.store(at, codes.to(tl.uint8), mask=row_ok[:, None] & (cols < N)[None, :])
    elif BITS == 4:
        low, high = tl.split(tl.reshape(codes, [BLOCK_M, BLOCK_N // 2, 2]))
        pairs = col0 // 2 + tl.arange(0, BLOCK_N // 2)
        at = CODES + rows[:, None] * stride_c + pairs[None, :]
        tl.store(at, (low | (high << 4)).to(tl.uint8), mask=row_ok[:, None] & (pairs * 2 < N)[None, :])
    else:
        even, odd = tl.split(tl.reshape(codes, [BLOCK_M, BLOCK_N // 4, 2, 2]))  # codes 4q + 2a and 4q + 2a + 1
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        word = c0 | (c1 << 6) | (c2 << 12) | (c3 << 18)
        quads = col0 // 4 + tl.arange(0, BLOCK_N // 4)
        mask = row_ok[:, None] & (quads * 4 < N)[None, :]
        at = CODES + rows[:, None] * stride_c + 3 * quads[None, :]
        tl.store(at, (word & 0xFF).to(tl.uint8), mask=mask)
        tl.store(at + 1, ((word >> 8) & 0xFF).to(tl.uint8), mask=mask)
        tl.store(at + 2, ((word >> 16) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _mx_quantize_kernel(
    X, CODES, SCALES, M, K, stride_x, stride_c, stride_s,
    EBITS: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr, ELEM_MAX: tl.constexpr, MAX_CODE: tl.constexpr,
    RCEIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # X: [M, K] (K a multiple of 32) -> CODES: packed [M, K * bits / 8], SCALES: E8M0 [M, K / 32]
    rows, cols, row_ok, col_ok = _tile(M, K, BLOCK_M, BLOCK_K)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    codes, scales = _mx_codes(x.to(tl.float32), EBITS, MBITS, EMAX, ELEM_MAX, MAX_CODE, RCEIL, BLOCK_M, BLOCK_K)
    col0 = tl.program_id(1).to(tl.int64) * BLOCK_K
    _store_mx(codes, scales, CODES, SCALES, rows, row_ok, col0, K, stride_c, stride_s, 1 + EBITS + MBITS, BLOCK_M,
              BLOCK_K)  # fmt: skip


ACTIVATIONS = {"gelu_tanh": 0, "swiglu": 1}
"""The MLP activations the fused up projection applies (the ``ACTIVATION`` constexpr): tanh-approximate GELU (Flux)
and SwiGLU (silu of the first half of the projection's outputs times the second, Krea 3)."""
GELU_SCALE: tl.constexpr = tl.constexpr(2 * math.sqrt(2 / math.pi))
GELU_CUBIC: tl.constexpr = tl.constexpr(2 * math.sqrt(2 / math.pi) * 0.044715)
"""GELU's tanh form 0.5 h (1 + tanh(sqrt(2 / pi) (h + 0.044715 h^3))) is h sigmoid(h (GELU_SCALE + GELU_CUBIC h^2))."""


@triton.jit
def _mx_gemm_act_kernel(
    A, A_SCALE, B, B_SCALE, BIAS, C_CODES, C_SCALE, M, N, K,
    stride_a, stride_as, stride_b, stride_bs, stride_c, stride_cs,
    ELEMENT: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr, ELEM_MAX: tl.constexpr, MAX_CODE: tl.constexpr,
    RCEIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # A: the MLP's input, MX [M, K]; B: its up projection, MX [N, K] (GELU) or [2N, K] (SwiGLU: the activated
    # half, then the multiplier); BIAS: [N] or [2N] -> C_CODES, C_SCALE: activation(A B^T + bias) quantized to MX
    # [M, N] (N a multiple of 32), the down projection's operand; the hidden state is never written.
    rows, cols, row_ok, col_ok = _tile(M, N, BLOCK_M, BLOCK_N)
    h = _mx_product(
        A, A_SCALE, B, B_SCALE, rows, cols, row_ok, col_ok, K, stride_a, stride_as, stride_b, stride_bs,
        ELEMENT, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        h += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 0:
        v = h * tl.sigmoid(h * (GELU_SCALE + GELU_CUBIC * h * h))
    else:
        gate = _mx_product(
            A, A_SCALE, B + N * stride_b, B_SCALE + N * stride_bs, rows, cols, row_ok, col_ok, K,
            stride_a, stride_as, stride_b, stride_bs, ELEMENT, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if HAS_BIAS:
            gate += tl.load(BIAS + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        v = h * tl.sigmoid(h) * gate
    v = tl.where(row_ok[:, None] & col_ok[None, :], v, 0.0)
    codes, scales = _mx_codes(v, EBITS, MBITS, EMAX, ELEM_MAX, MAX_CODE, RCEIL, BLOCK_M, BLOCK_N)
    col0 = tl.program_id(1).to(tl.int64) * BLOCK_N
    _store_mx(codes, scales, C_CODES, C_SCALE, rows, row_ok, col0, N, stride_c, stride_cs, 1 + EBITS + MBITS,
              BLOCK_M, BLOCK_N)  # fmt: skip


QUANTIZE_TILES = {"BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4}
"""The activation quantizer's tile (not yet timed on gfx950)."""
ACT_TILES = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
"""The fused up projection's tile: N 64 wide, so that SwiGLU's two accumulators and the quantizing epilogue fit
the registers without spills (the compile tier checks it on gfx950); not yet timed there."""


def _mx_out(m: int, n: int, element: str, device, codes=None, scales=None):
    """Codes [m, n * bits / 8] and scales [m, n / 32] to write into (given ones: checked)."""
    width = n * formats.element_format(element).bits // 8
    codes = torch.empty(m, width, dtype=torch.uint8, device=device) if codes is None else codes
    scales = torch.empty(m, n // BLOCK, dtype=torch.uint8, device=device) if scales is None else scales
    if tuple(codes.shape) != (m, width) or tuple(scales.shape) != (m, n // BLOCK) or codes.stride(1) != 1:
        raise ValueError(f"outputs {tuple(codes.shape)}, {tuple(scales.shape)} do not hold [{m}, {n}] {element} codes")
    return codes, scales


def mx_quantize(
    x: torch.Tensor, element: str, scale_mode: str = "rceil", codes=None, scales=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> (packed codes, E8M0 scales), equal to ``formats.quantize_mx(x, element, 32,
    scale_mode)`` for finite x, in one pass. ``codes``, ``scales``: where to write them (column views of a wider
    operand: the MLP's joined input)."""
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"the last dim ({k}) must be a multiple of the block size {BLOCK}")
    codes, scales = _mx_out(m, k, element, x.device, codes, scales)
    t = QUANTIZE_TILES
    grid = (triton.cdiv(m, t["BLOCK_M"]), triton.cdiv(k, t["BLOCK_K"]))
    _mx_quantize_kernel[grid](
        x, codes, scales, m, k, x.stride(0), codes.stride(0), scales.stride(0),
        **element_constants(element), RCEIL=scale_mode == "rceil", **t,
    )  # fmt: skip
    return codes, scales


def mx_gemm_act(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    b_codes: torch.Tensor,
    b_scales: torch.Tensor,
    bias: torch.Tensor | None,
    element: str,
    activation: str,
    scale_mode: str = "rceil",
    codes=None,
    scales=None,
    tiles: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLP's up projection and activation, quantized: ``formats.quantize_mx(activation(A B^T + bias))`` with A B^T
    as ``mx_gemm`` computes it (fp32), the activation in fp32, never written. B [N, K] for ``gelu_tanh``, [2N, K] for
    ``swiglu``; -> (packed codes [M, N * bits / 8], E8M0 scales [M, N / 32]): the down projection's operand."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; the fused up projection applies {', '.join(ACTIVATIONS)}")
    m, k = a_codes.shape[0], a_scales.shape[1] * BLOCK
    n = b_codes.shape[0] // (2 if activation == "swiglu" else 1)
    if n % BLOCK or b_scales.shape[1] != a_scales.shape[1]:
        raise ValueError(f"weight {tuple(b_codes.shape)} does not give N a multiple of {BLOCK} over K = {k}")
    codes, scales = _mx_out(m, n, element, a_codes.device, codes, scales)
    a_codes, a_scales, b_codes, b_scales = (t.contiguous() for t in (a_codes, a_scales, b_codes, b_scales))
    t = {**ACT_TILES, **(tiles or {})}
    grid = (triton.cdiv(m, t["BLOCK_M"]), triton.cdiv(n, t["BLOCK_N"]))
    _mx_gemm_act_kernel[grid](
        a_codes, a_scales, b_codes, b_scales, a_scales if bias is None else bias, codes, scales, m, n, k,
        a_codes.stride(0), a_scales.stride(0), b_codes.stride(0), b_scales.stride(0), codes.stride(0),
        scales.stride(0), ELEMENT=ELEMENTS[element], ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=bias is not None,
        **element_constants(element), RCEIL=scale_mode == "rceil", **t,
    )  # fmt: skip
    return codes, scales
