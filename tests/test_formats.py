"""The reference codecs, code by code: values, rounding ties, saturation, subnormals, zero blocks, NaN."""

import math

import pytest
import torch

from ditrun.kernels import formats as F

# The OCP MX v1.0 spec's value sets (non-negative, code order).
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M3 = [m / 8 for m in range(8)] + [(1 + m / 8) * 2.0**e for e in range(0, 3) for m in range(8)]
E3M2 = [m / 16 for m in range(4)] + [(1 + m / 4) * 2.0**e for e in range(-2, 5) for m in range(4)]
SPEC_VALUES = {"fp4_e2m1": E2M1, "fp6_e2m3": E2M3, "fp6_e3m2": E3M2}
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "fp6_e2m3": 7.5, "fp6_e3m2": 28.0, "fp4_e2m1": 6.0}
ALL = list(F.FORMATS)


def all_codes(fmt: str) -> torch.Tensor:
    return torch.arange(2 ** F.FORMATS[fmt].bits, dtype=torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN, and zeros with the same sign."""
    return (
        torch.equal(torch.isnan(a), torch.isnan(b))
        and torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
        and torch.equal(torch.signbit(a), torch.signbit(b))
    )


@pytest.mark.parametrize("fmt", SPEC_VALUES)
def test_every_code_of_the_mx_element_formats_has_the_spec_value(fmt):
    values = F.decode(all_codes(fmt), fmt)
    half = len(values) // 2
    assert values[:half].tolist() == SPEC_VALUES[fmt]
    assert same(values[half:], -torch.tensor(SPEC_VALUES[fmt]))
    assert F.FORMATS[fmt].max_value == MAX[fmt]


@pytest.mark.parametrize("fmt", TORCH_FP8)
def test_every_fp8_code_decodes_as_torch_float8(fmt):
    codes = all_codes(fmt)
    assert same(F.decode(codes, fmt), codes.view(TORCH_FP8[fmt]).float())
    assert F.FORMATS[fmt].max_value == MAX[fmt]


@pytest.mark.parametrize("fmt", ALL)
def test_every_code_round_trips(fmt):
    codes = all_codes(fmt)
    values = F.decode(codes, fmt)
    finite = torch.isfinite(values)
    assert torch.equal(F.encode(values[finite], fmt), codes[finite])
    if fmt == "fp8_e4m3":
        assert torch.isnan(values).sum() == 2  # only S.1111.111


@pytest.mark.parametrize("fmt", ALL)
def test_ties_round_to_the_even_code_and_other_points_to_the_nearest(fmt):
    values = F.finite_values(F.FORMATS[fmt]).double()
    lo, hi = values[:-1], values[1:]
    mid = ((lo + hi) / 2).float()
    codes = F.encode(torch.cat([mid, -mid]), fmt).long()
    n = len(mid)
    expected = torch.arange(n) + (torch.arange(n) % 2)  # the even of (i, i+1)
    sign = 1 << (F.FORMATS[fmt].bits - 1)
    assert torch.equal(codes[:n], expected) and torch.equal(codes[n:], expected | sign)
    # Just below / above a midpoint goes down / up.
    below = torch.nextafter(mid, torch.zeros_like(mid))
    above = torch.nextafter(mid, torch.full_like(mid, math.inf))
    assert torch.equal(F.encode(below, fmt).long(), torch.arange(n))
    assert torch.equal(F.encode(above, fmt).long(), torch.arange(n) + 1)


@pytest.mark.parametrize("fmt", TORCH_FP8)
def test_fp8_encoding_equals_torch_casts_on_random_values(fmt):
    x = torch.randn(50000, generator=torch.Generator().manual_seed(0)) * 2.0 ** torch.randint(-20, 12, (50000,))
    x = x.clamp(-MAX[fmt], MAX[fmt])
    assert torch.equal(F.encode(x, fmt), x.to(TORCH_FP8[fmt]).view(torch.uint8))


@pytest.mark.parametrize("fmt", ALL)
def test_saturation_subnormals_zero_and_nan(fmt):
    element = F.FORMATS[fmt]
    big = torch.tensor([MAX[fmt] * 1.5, math.inf, -math.inf, -1e30])
    assert F.decode(F.encode(big, fmt), fmt).tolist() == [MAX[fmt], MAX[fmt], -MAX[fmt], -MAX[fmt]]
    smallest = F.finite_values(element)[1].item()
    assert smallest == 2.0 ** (1 - element.bias - element.mantissa_bits)  # a subnormal, kept
    tiny = torch.tensor([smallest, smallest * 0.5, smallest * 0.51, -0.0])
    assert same(F.decode(F.encode(tiny, fmt), fmt), torch.tensor([smallest, 0.0, smallest, -0.0]))
    nan = F.decode(F.encode(torch.tensor([math.nan]), fmt), fmt)
    assert torch.isnan(nan).all() if element.nan_codes else nan.tolist() == [0.0]


@pytest.mark.parametrize("fmt", ALL)
def test_packing_layout_and_round_trip(fmt):
    bits = F.FORMATS[fmt].bits
    codes = torch.randint(0, 2**bits, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = F.pack(codes, fmt)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(F.unpack(packed, fmt), codes)
    first = codes[0, :4].tolist()
    if bits == 4:
        assert packed[0, 0].item() == first[0] | (first[1] << 4)
    if bits == 6:
        word = first[0] | first[1] << 6 | first[2] << 12 | first[3] << 18
        assert packed[0, :3].tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("scale_mode", F.SCALE_MODES)
def test_mx_scales_follow_the_rule_exactly(fmt, scale_mode):
    element = F.FORMATS[fmt]
    # One block per amax: powers of two, the element max times powers of two, and just above them.
    base = torch.tensor([1.0, MAX[fmt], 3.0, 1e-3, 5e4])
    amax = torch.cat([base, torch.nextafter(base, torch.full_like(base, math.inf))])
    x = torch.zeros(len(amax), 32)
    x[:, 5] = -amax
    _, scales = F.quantize_mx(x, fmt, scale_mode=scale_mode)
    exponent = scales[:, 0].long() - 127
    for a, e in zip(amax.double().tolist(), exponent.tolist()):
        floor_rule = math.floor(math.log2(a)) - element.emax
        if scale_mode == "floor":
            assert e == floor_rule
        else:
            assert a <= MAX[fmt] * 2.0**e and (a > MAX[fmt] * 2.0 ** (e - 1))  # the smallest scale that fits


@pytest.mark.parametrize("fmt", ALL)
def test_mx_round_trip_zero_blocks_and_nan_blocks(fmt):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 96, generator=gen) * 2.0 ** torch.randint(-8, 8, (4, 3, 1), generator=gen).repeat_interleave(
        32, 1
    ).flatten(1)
    x[1, :32] = 0.0
    x[2, 40] = math.nan
    codes, scales = F.quantize_mx(x, fmt)
    assert scales.shape == (4, 3) and scales.dtype == torch.uint8
    assert scales[1, 0] == 0 and scales[2, 1] == F.E8M0_NAN
    y = F.dequantize_mx(codes, scales, fmt)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.equal(y[1, :32], torch.zeros(32)) and torch.isnan(y[2, 32:64]).all()
    # Every other element is the nearest value of its block's grid: error at most half a step of the top binade.
    ok = ~torch.isnan(y)
    scale = F.decode_e8m0(scales).repeat_interleave(32, dim=1)
    step = scale * 2.0 ** (F.FORMATS[fmt].emax - F.FORMATS[fmt].mantissa_bits)
    assert ((y - x).abs() <= step / 2)[ok].all()
    # Quantizing a dequantized tensor again changes nothing (rceil scales are stable).
    again = F.quantize_mx(torch.nan_to_num(y), fmt)
    assert torch.equal(F.dequantize_mx(*again, fmt), torch.nan_to_num(y))


def test_fake_quantize_keeps_dtype_and_fp8_rowwise():
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    assert F.fake_quantize(x, "fp6_e2m3").dtype == torch.bfloat16
    codes, scale = F.quantize_fp8(x.float())
    assert scale.shape == (8, 1)
    assert torch.equal(codes, (x.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    err = (F.fake_quantize_fp8(x.float()) - x.float()).abs().max() / x.float().abs().max()
    assert err < 2**-4
    assert F.quantize_fp8(x, rowwise=False)[1].shape == ()


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("scale_mode", F.SCALE_MODES)
def test_fake_quantize_equals_quantize_then_dequantize(fmt, scale_mode):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 128, generator=gen) * 2.0 ** torch.randint(-30, 30, (6, 128), generator=gen)
    x[0, :32] = 0.0
    x[1, 3], x[2, 70], x[3, 100] = math.nan, math.inf, -math.inf
    assert same(
        F.fake_quantize(x, fmt, scale_mode=scale_mode),
        F.dequantize_mx(*F.quantize_mx(x, fmt, scale_mode=scale_mode), fmt),
    )
    if fmt.startswith("fp8"):  # per-row FP8 of finite rows (an infinite row has no meaningful fp32 scale)
        finite = x[[0, 4, 5]]
        assert same(F.fake_quantize_fp8(finite, fmt), F.dequantize_fp8(*F.quantize_fp8(finite, fmt), fmt))


# The spec's parameters of each element format: (exponent bits, mantissa bits, NaN magnitude codes, infinity code,
# max, emax_elem).
SPEC = {
    "fp8_e4m3": (4, 3, (0x7F,), None, 448.0, 8),
    "fp8_e5m2": (5, 2, (0x7D, 0x7E, 0x7F), 0x7C, 57344.0, 15),
    "fp6_e2m3": (2, 3, (), None, 7.5, 2),
    "fp6_e3m2": (3, 2, (), None, 28.0, 4),
    "fp4_e2m1": (2, 1, (), None, 6.0, 2),
}


@pytest.mark.parametrize("fmt", ALL)
def test_a_format_built_from_its_bit_fields_has_the_spec_values(fmt):
    """Built here (``FORMATS`` is built at import, before a test runs): every field against the spec."""
    e, m, nan_codes, inf_code, max_value, emax = SPEC[fmt]
    built = F.ElementFormat(fmt, e, m, nan_codes=nan_codes, inf_code=inf_code)
    assert (built.bits, built.bias, built.max_value, built.emax) == (1 + e + m, 2 ** (e - 1) - 1, max_value, emax)
    if fmt in TORCH_FP8:
        want = torch.arange(128, dtype=torch.uint8).view(TORCH_FP8[fmt]).float()
    else:
        want = torch.tensor(SPEC_VALUES[fmt])
    assert same(torch.tensor(built.magnitudes), want)
    assert list(built.finite) == [v for v in want.tolist() if math.isfinite(v)]
    assert all(math.isnan(built.magnitude(c)) for c in nan_codes)
    assert inf_code is None or built.magnitude(inf_code) == math.inf


def _nearest_bound(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """Half a grid step of the format at each |x| / scale, times the scale: the most a nearest rounding inside the
    range may move x (the step of the binade of |x / scale|, never finer than the subnormals')."""
    e, m = SPEC[fmt][:2]
    bias = 2 ** (e - 1) - 1
    y = (x / scale).abs().double()
    binade = torch.floor(torch.log2(y.clamp(min=2.0**-200))).clamp(min=1 - bias)
    return (2.0 ** (binade - m) / 2 * scale).float()


@pytest.mark.parametrize("fmt", TORCH_FP8)
@pytest.mark.parametrize("rowwise", [True, False])
def test_fp8_scale_is_amax_over_the_max_and_the_round_trip_is_within_half_a_step(fmt, rowwise):
    x = (
        torch.randn(6, 40, generator=torch.Generator().manual_seed(4))
        * torch.tensor([1e-3, 1, 7, 300, 2e4, 1])[:, None]
    )
    x[5] = 0.0
    codes, scale = F.quantize_fp8(x, fmt, rowwise)
    amax = x.double().abs().amax(dim=-1, keepdim=True) if rowwise else x.double().abs().amax()
    want = torch.where(amax > 0, amax / MAX[fmt], torch.ones_like(amax)).float()
    assert scale.shape == want.shape and torch.equal(scale, want)
    y = F.dequantize_fp8(codes, scale, fmt)
    assert ((y - x).abs() <= _nearest_bound(x, fmt, scale)).all()
    assert torch.equal(F.fake_quantize_fp8(x, fmt, rowwise), y)
    assert y.abs().amax() <= x.abs().amax()  # the row's amax lands on the max exactly: nothing saturates


@pytest.mark.parametrize("fmt", ALL)
def test_mx_round_trip_is_within_half_a_step_of_each_elements_binade(fmt):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=gen) * 2.0 ** torch.randint(-6, 6, (3, 64), generator=gen)
    codes, scales = F.quantize_mx(x, fmt, block=16)
    assert codes.shape == (3, 64 * F.FORMATS[fmt].bits // 8) and scales.shape == (3, 4)
    # rceil: the smallest power of two whose element max holds the block's amax
    amax = x.double().abs().unflatten(-1, (4, 16)).amax(dim=-1)
    want = torch.ceil(torch.log2(amax / MAX[fmt]))
    assert torch.equal(scales.long() - 127, want.long())
    scale = torch.exp2(want).float().repeat_interleave(16, dim=1)
    y = F.dequantize_mx(codes, scales, fmt)
    assert ((y - x).abs() <= _nearest_bound(x, fmt, scale)).all()
    assert torch.equal(F.fake_quantize(x, fmt, block=16), y)


def test_e8m0_scales_decode_to_powers_of_two_and_nan():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = F.decode_e8m0(codes)
    assert got[:-1].double().tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(got[-1]) and got.dtype == torch.float32


def test_fp8_power_of_two_scale_is_the_smallest_that_holds_the_amax():
    amax = torch.tensor([448.0, 449.0, 1.0, 224.0, 3e-5, 0.0])
    got = F.fp8_power_of_two_scale(amax).double()
    assert got.tolist() == [1.0, 2.0, 2.0**-8, 0.5, 2.0**-23, 2.0**-127]


def test_a_block_size_that_does_not_divide_the_row_is_refused():
    with pytest.raises(ValueError, match="the last dim \\(40\\) must be a multiple of the block size 32"):
        F.quantize_mx(torch.ones(3, 2, 40), "fp8_e4m3")
    with pytest.raises(ValueError, match="^scale_mode='round'; allowed: rceil, floor$"):
        F.shared_exponents(torch.ones(2), F.FORMATS["fp8_e4m3"], "round")


def test_codes_are_bytes_and_fast_paths_keep_the_dtype():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    for fmt in ALL:
        codes = F.encode(x, fmt)
        assert codes.dtype == torch.uint8
        assert F.pack(codes, fmt).dtype == torch.uint8 and F.unpack(F.pack(codes, fmt), fmt).dtype == torch.uint8
        stacked = torch.stack([codes, codes.flip(0)])  # [2, 2, 64]: packed along the last dim only
        assert torch.equal(F.pack(stacked, fmt), torch.stack([F.pack(codes, fmt), F.pack(codes.flip(0), fmt)]))
    assert F.fake_quantize_fp8(x.bfloat16()).dtype == torch.bfloat16
    codes, scale = F.quantize_fp8(x)
    assert torch.equal(F.dequantize_fp8(codes, scale), F.decode(codes, "fp8_e4m3") * scale)  # E4M3 by default
    assert F.fp8_power_of_two_scale(torch.tensor([3.0], dtype=torch.float64)).dtype == torch.float32
    assert torch.equal(F.fp8_scale(x), x.abs().amax(dim=-1, keepdim=True) / 448)  # E4M3, per row by default


def test_the_smallest_scale_is_e8m0s_and_a_block_far_below_it_flushes_to_zero():
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = 2.0**-140, 2.0**-110  # 2^-127 is the smallest scale E8M0 holds
    codes, scales = F.quantize_mx(x, "fp8_e4m3")
    assert scales.tolist() == [[0], [127 - 110 - 8]]  # 2^-127; 2^(floor(log2 amax) - emax)
    # 2^-140 / 2^-127 is below half E4M3's smallest subnormal (2^-9)
    assert F.dequantize_mx(codes, scales, "fp8_e4m3")[:, 0].tolist() == [0.0, 2.0**-110]
