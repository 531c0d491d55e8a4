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
"""

from __future__ import annotations

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
    FORMAT: tl.constexpr = "e2m1" if ELEMENT == 3 else "e4m3"
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
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
