"""Exact reference codecs for the OCP 8-bit floating point and Microscaling (MX v1.0) formats.

Element formats: FP8 E4M3 (OCP "fn": no infinities, 0x7F/0xFF = NaN, max 448) and E5M2 (IEEE-like,
max 57344), FP6 E2M3 (max 7.5) and E3M2 (max 28), FP4 E2M1 (max 6); scales: E8M0 (a biased
power-of-two exponent, bias 127, 0xFF = NaN).

Every codec here is built from the table of the format's values, so it is exact on every device
(CPU included) and needs no hardware float8 type: encoding finds the two representable neighbours
of each value with ``bucketize`` and picks the nearer, ties to the even code (round to nearest
even: a code's lowest bit is its mantissa's lowest bit), saturating to +-max; subnormals are kept,
signed zeros keep their sign, NaN propagates. Fast paths (``torch.float8_*`` casts, hardware
GEMMs) are tested against these codecs.

MX blocks run along the last dim (``block`` divides it). Codes come back packed: FP8 one per byte,
FP6 four codes per three bytes little-endian (``c0 | c1<<6 | c2<<12 | c3<<18``), FP4 two per byte
(element 2i in the low nibble). Scales are uint8 E8M0 of shape ``[..., K / block]``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_MODES = ("rceil", "floor")


@dataclass(frozen=True)
class ElementFormat:
    """A sign-exponent-mantissa format of at most 8 bits."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    nan_codes: tuple[int, ...] = ()
    """Magnitude codes (sign bit clear) that mean NaN."""
    inf_code: int | None = None
    """Magnitude code of infinity, where the format has one (E5M2); it is never produced: values saturate."""
    # The constants below are plain Python numbers filled once, when the format is defined: a traced
    # (torch.compile'd) quantizer reads them as constants instead of tracing the code-table walk.
    bits: int = field(init=False)
    bias: int = field(init=False)
    magnitudes: tuple[float, ...] = field(init=False, repr=False)
    """The value of every magnitude code (sign bit clear), NaN and infinity included."""
    finite: tuple[float, ...] = field(init=False, repr=False)
    """The non-negative finite values in code order (increasing)."""
    max_value: float = field(init=False)
    """The largest finite value."""
    emax: int = field(init=False)
    """Exponent of the largest normal value (the OCP ``emax_elem``)."""

    def __post_init__(self):
        set_constant = functools.partial(object.__setattr__, self)  # frozen: set once, here
        set_constant("bits", 1 + self.exponent_bits + self.mantissa_bits)
        set_constant("bias", 2 ** (self.exponent_bits - 1) - 1)
        set_constant("magnitudes", tuple(map(self.magnitude, range(2 ** (self.bits - 1)))))
        set_constant("finite", tuple(v for v in self.magnitudes if math.isfinite(v)))
        set_constant("max_value", max(self.finite))
        set_constant("emax", math.frexp(self.max_value)[1] - 1)

    def magnitude(self, code: int) -> float:
        """The value of a magnitude code (sign bit clear), from the bit fields."""
        exponent, mantissa = code >> self.mantissa_bits, code & ((1 << self.mantissa_bits) - 1)
        if code in self.nan_codes:
            return float("nan")
        if code == self.inf_code:
            return float("inf")
        if exponent == 0:  # subnormal
            return mantissa * 2.0 ** (1 - self.bias - self.mantissa_bits)
        return (1 + mantissa / 2**self.mantissa_bits) * 2.0 ** (exponent - self.bias)


FORMATS: dict[str, ElementFormat] = {
    # OCP FP8 "fn": the all-ones exponent holds normal values; only S.1111.111 is NaN.
    "fp8_e4m3": ElementFormat("fp8_e4m3", 4, 3, nan_codes=(0x7F,)),
    "fp8_e5m2": ElementFormat("fp8_e5m2", 5, 2, nan_codes=(0x7D, 0x7E, 0x7F), inf_code=0x7C),
    "fp6_e2m3": ElementFormat("fp6_e2m3", 2, 3),
    "fp6_e3m2": ElementFormat("fp6_e3m2", 3, 2),
    "fp4_e2m1": ElementFormat("fp4_e2m1", 2, 1),
}


def element_format(fmt: str | ElementFormat) -> ElementFormat:
    return fmt if isinstance(fmt, ElementFormat) else FORMATS[fmt]


def finite_values(fmt: ElementFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """Non-negative finite values in code order (code i has value [i]); increasing. fp32."""
    return torch.tensor(fmt.finite, dtype=torch.float32, device=device)


def decode(codes: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Unpacked codes (uint8, one per byte) -> float32 values."""
    fmt = element_format(fmt)
    table = torch.tensor(fmt.magnitudes, dtype=torch.float32, device=codes.device)
    sign_bit = 1 << (fmt.bits - 1)
    codes = codes.long()
    value = table[codes & (sign_bit - 1)]
    return torch.where((codes & sign_bit) != 0, -value, value)


def encode(x: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """float values -> unpacked codes (uint8): round to nearest even, saturate to +-max, NaN kept.

    A format without NaN (FP6, FP4) encodes NaN as 0; MX carries it in the block's scale instead.
    """
    # x: any shape -> codes of the same shape
    fmt = element_format(fmt)
    values = finite_values(fmt, x.device)
    y = x.float()
    mag = y.abs().clamp(max=values[-1])
    hi = torch.bucketize(mag.contiguous(), values).clamp(max=len(values) - 1)  # values[hi - 1] < mag <= values[hi]
    lo = (hi - 1).clamp(min=0)
    midpoint = (values[lo] + values[hi]) * 0.5  # exact: both have few significant bits
    take_hi = (mag > midpoint) | ((mag == midpoint) & (hi % 2 == 0))
    code = torch.where(take_hi, hi, lo)
    code = code | (torch.signbit(y).long() << (fmt.bits - 1))
    nan = fmt.nan_codes[-1] | (1 << (fmt.bits - 1)) if fmt.nan_codes else 0
    return torch.where(torch.isnan(y), nan, code).to(torch.uint8)


def round_to_grid(v: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Round fp32 values onto the format's grid, as ``decode(encode(v))`` (tested equal), arithmetically.

    The grid step in v's binade is 2^(exponent - mantissa_bits), never finer than the subnormals';
    ``torch.round`` rounds half to even, and an even multiple of the step is an even code. Plain
    tensor arithmetic, so it is fast and torch.compile fuses it; the table codec stays the reference.
    """
    fmt = element_format(fmt)
    exponent = floor_log2(v.abs()).clamp(min=1 - fmt.bias)
    step = torch.ldexp(torch.ones_like(v), (exponent - fmt.mantissa_bits).float())
    return (torch.round(v / step) * step).clamp(-fmt.max_value, fmt.max_value)


# ---------------------------------------------------------------------------------------------
# Packing


def pack(codes: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Unpacked codes [..., K] -> bytes: FP8 [..., K], FP6 [..., 3K/4], FP4 [..., K/2]."""
    bits = element_format(fmt).bits
    c = codes.to(torch.int32)
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:
        pairs = c.unflatten(-1, (-1, 2))
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    quads = c.unflatten(-1, (-1, 4))
    word = quads[..., 0] | (quads[..., 1] << 6) | (quads[..., 2] << 12) | (quads[..., 3] << 18)
    return torch.stack([(word >> shift) & 0xFF for shift in (0, 8, 16)], dim=-1).flatten(-2).to(torch.uint8)


def unpack(packed: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """The inverse of ``pack``: bytes -> unpacked codes [..., K] (uint8)."""
    bits = element_format(fmt).bits
    p = packed.to(torch.int32)
    if bits == 8:
        return packed.to(torch.uint8)
    if bits == 4:
        return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2).to(torch.uint8)
    triples = p.unflatten(-1, (-1, 3))
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
    return torch.stack([(word >> shift) & 0x3F for shift in (0, 6, 12, 18)], dim=-1).flatten(-2).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# MX: blocks sharing one E8M0 scale


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) of positive finite fp32 values, exactly (frexp, not a rounded log)."""
    return torch.frexp(x).exponent.long() - 1


def shared_exponents(amax: torch.Tensor, fmt: ElementFormat, scale_mode: str = "rceil") -> torch.Tensor:
    """The unbiased power-of-two scale exponent of each block, clamped to E8M0's [-127, 127].

    ``floor`` is OCP v1.0's 2^(floor(log2 amax) - emax_elem): the block's largest value may then
    exceed the element max and saturate. ``rceil`` rounds the needed scale amax / max_elem up to a
    power of two (NVIDIA's and AITER's rule), so nothing saturates. Both are computed exactly:
    the floor exponent s0 puts amax / 2^s0 in [2^emax, 2^(emax+1)), and rceil adds one where
    amax > max_elem * 2^s0 (both sides exact in fp32). An all-zero block gets the smallest scale.
    """
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r}; allowed: {', '.join(SCALE_MODES)}")
    finite = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(finite, amax, torch.ones_like(amax))
    exponent = floor_log2(safe) - fmt.emax
    if scale_mode == "rceil":
        exponent = exponent + (safe > torch.ldexp(torch.full_like(safe, fmt.max_value), exponent)).long()
    exponent = torch.where(amax == 0, -E8M0_BIAS, exponent)
    exponent = torch.where(torch.isinf(amax), E8M0_BIAS, exponent)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS)


def fp8_power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 power-of-two E4M3 scale of each amax (``rceil``: amax / scale lands at or below 448)."""
    return torch.ldexp(
        torch.ones_like(amax, dtype=torch.float32), shared_exponents(amax, FORMATS["fp8_e4m3"], "rceil").float()
    )


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of the block size {block}")
    return x.float().unflatten(-1, (-1, block))  # [..., K] -> [..., K/block, block]


def quantize_mx(x: torch.Tensor, fmt: str, block: int = 32, scale_mode: str = "rceil"):
    """x [..., K] -> (packed codes uint8, E8M0 scales uint8 [..., K/block]).

    A block holding a NaN gets the NaN scale (0xFF); an infinity saturates to +-max.
    """
    element = element_format(fmt)
    blocks = _blocks(x, block)
    amax = torch.nan_to_num(blocks.abs(), nan=0.0).amax(dim=-1)
    exponent = shared_exponents(amax, element, scale_mode)
    scaled = torch.ldexp(blocks, -exponent[..., None].float())  # exact: a power of two
    codes = encode(scaled, element).flatten(-2)
    has_nan = torch.isnan(blocks).any(dim=-1)
    scales = torch.where(has_nan, E8M0_NAN, exponent + E8M0_BIAS).to(torch.uint8)
    return pack(codes, element), scales


def decode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 powers of two (0xFF -> NaN). 2^-127 is an fp32 subnormal: exact."""
    s = scales.long()
    value = torch.ldexp(torch.ones_like(s, dtype=torch.float32), (s - E8M0_BIAS).float())
    return torch.where(s == E8M0_NAN, float("nan"), value)


def dequantize_mx(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """(packed codes, E8M0 scales) -> float32 of the original shape; the block is K / scales.shape[-1]."""
    values = decode(unpack(codes, fmt), fmt)  # [..., K]
    per_block = values.unflatten(-1, (scales.shape[-1], -1))
    return (per_block * decode_e8m0(scales)[..., None]).flatten(-2)


def fake_quantize(x: torch.Tensor, fmt: str, block: int = 32, scale_mode: str = "rceil") -> torch.Tensor:
    """Quantize to MX and back, in x's dtype: what an MX GEMM sees of x.

    Equal to ``dequantize_mx(*quantize_mx(x, ...))`` (tested), computed without codes: a few times faster.
    """
    element = element_format(fmt)
    blocks = _blocks(x, block)
    amax = torch.nan_to_num(blocks.abs(), nan=0.0).amax(dim=-1, keepdim=True)
    exponent = shared_exponents(amax, element, scale_mode).float()
    values = torch.ldexp(round_to_grid(torch.ldexp(blocks, -exponent), element), exponent)
    values = torch.where(torch.isnan(blocks).any(dim=-1, keepdim=True), float("nan"), values)  # the NaN scale
    return values.flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# FP8 with one fp32 scale per tensor or per row (the torch._scaled_mm convention: x ~ codes * scale)


def fp8_scale(x: torch.Tensor, fmt: str = "fp8_e4m3", rowwise: bool = True) -> torch.Tensor:
    """amax / max_elem per row ([..., 1]) or per tensor ([]); 1 where the amax is 0. fp32."""
    amax = x.detach().float().abs()
    amax = amax.amax(dim=-1, keepdim=True) if rowwise else amax.amax()
    return torch.where(amax > 0, amax / element_format(fmt).max_value, torch.ones_like(amax))


def quantize_fp8(x: torch.Tensor, fmt: str = "fp8_e4m3", rowwise: bool = True):
    """x [..., K] -> (codes uint8 [..., K], fp32 scale [..., 1] or [])."""
    scale = fp8_scale(x, fmt, rowwise)
    return encode(x.float() / scale, fmt), scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, fmt: str = "fp8_e4m3") -> torch.Tensor:
    return decode(codes, fmt) * scale


def fake_quantize_fp8(x: torch.Tensor, fmt: str = "fp8_e4m3", rowwise: bool = True) -> torch.Tensor:
    """``dequantize_fp8(*quantize_fp8(x))`` in x's dtype (tested equal), computed without codes."""
    scale = fp8_scale(x, fmt, rowwise)
    return (round_to_grid(x.float() / scale, fmt) * scale).to(x.dtype)
