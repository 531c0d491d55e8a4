"""The precision seam: registries and config checks, the component map, quantized linears
(emulation, and every fast backend against it), INT8-QK attention, labels and the dispatch table."""

import functools
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from launching import relative_error, tiny_config

from ditrun import config
from ditrun.errors import UserError
from ditrun.kernels import formats
from ditrun.kernels import linear as L
from ditrun.kernels.attention import (
    ATTENTION_KERNELS,
    int8qk_attention_op,
    int8qk_emulation,
    quantize_int8_rows,
    quantize_operands,
)
from ditrun.kernels.fp8_sdpa import (
    P_SCALE,
    attend_fp8_pv,
    fp8_pv_emulation,
    fp8_pv_operands,
    fp8_pv_scales,
    fp8_sdpa_op,
)
from ditrun.kernels.tuning import DispatchTable, entry_key, m_bucket
from ditrun.model.build import build_model, select_device_dtype
from ditrun.model.components import COMPONENT_LINEARS, component_linears
from ditrun.model.dit import FluxDiT, gelu_activation, sdpa_attention
from ditrun.model.precision import plan_precision, precision_label
from ditrun.model.presets import geometry_from_config

MX = ["mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4"]
QUANTIZED = ["fp8", *MX]
CPU = torch.device("cpu")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Registries and config


def test_config_docstrings_name_every_registered_choice():
    source = inspect.getsource(config.PrecisionConfig)
    for name in [*L.LINEAR_FORMATS, *ATTENTION_KERNELS]:
        assert f"``{name}``" in source, name


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "precision.mlp=fp7",
            "precision.mlp='fp7' is not a known linear format; allowed: bf16, fp8, mxfp8, mxfp6, mxfp6_e3m2, mxfp4.",
        ),
        (
            "precision.attention=int4",
            "precision.attention='int4' is not a known attention kernel; allowed: bf16, "
            "fp8_pv, int8qk, int8qk_fp8v, int8qk_mxfp6v.",
        ),
        (
            "precision.backend=cuda",
            "precision.backend='cuda' is not a known linear backend; allowed: auto, fast, "
            "emulation, fp8_rowwise, fp8_rowwise_fast, mx_repack_fp8, mx_scaled_mm, mx_triton, aiter_fp8.",
        ),
        ("precision.scale_mode=round", "precision.scale_mode='round' is unknown; allowed: rceil, floor."),
        (
            "precision.backend=fast",
            "precision.backend=fast but precision.qkv=fp8 has no fast backend on cpu; "
            "use precision.backend=auto (exact emulation) or another format.",
        ),
        (
            "precision.attention=fp8_pv precision.backend=fast precision.qkv=bf16 precision.mlp=bf16 precision.out=bf16",
            "precision.backend=fast but precision.attention=fp8_pv needs a GPU (cuDNN's FP8 SDPA on NVIDIA sm_90+, AITER on "
            "AMD gfx950); use precision.backend=auto or another kernel.",
        ),
    ],
)
def test_precision_mistakes_are_one_sentence(override, message):
    cfg = tiny_config("precision=fp8", *override.split())
    with pytest.raises(UserError) as err:
        plan_precision(cfg.precision, CPU)
    assert str(err.value) == message


def test_labels_name_what_ran():
    cases = {
        ("bf16",): "fp32",
        ("fp8",): "fp8+fp32",
        ("krea",): "krea+fp32",
        ("fp8_all",): "fp8_all+fp32",
        ("fp8_int8qk",): "fp8_int8qk+fp32",
        ("bf16", "precision.mlp=mxfp6"): "mlp=mxfp6+fp32",
        ("fp8", "precision.attention=int8qk"): "qkv=fp8,out=fp8,mlp=fp8,attention=int8qk+fp32",
    }
    for overrides, label in cases.items():
        cfg = tiny_config(f"precision={overrides[0]}", *overrides[1:])
        assert precision_label(plan_precision(cfg.precision, CPU), "fp32") == label
    assert precision_label(plan_precision(tiny_config("precision=krea").precision, CPU), "bf16") == "krea"


# ---------------------------------------------------------------------------------------------
# The component map and the quantized model


@pytest.mark.parametrize("variant", ["flux", "krea3"])
def test_every_block_linear_but_the_modulation_has_one_component(variant):
    with torch.device("meta"):
        model = FluxDiT(geometry_from_config(tiny_config(f"model.variant={variant}").model))
    found = component_linears(model)
    covered = {n for names in found.values() for n in names}
    blocks = {
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "blocks." in n and ".norm" not in n
    }
    assert covered == blocks
    per_double = {"qkv": 8 if variant == "krea3" else 6, "out": 2, "mlp": 4}
    per_single = {"qkv": 4 if variant == "krea3" else 3, "out": 0, "mlp": 2}
    for component in COMPONENT_LINEARS:
        assert len(found[component]) == 2 * per_double[component] + 2 * per_single[component]


@functools.cache  # built once per session: the tests only read the models
def _quantized_model(precision, variant="flux", *overrides):
    cfg = tiny_config(f"precision={precision}", f"model.variant={variant}", *overrides)
    placement = select_device_dtype("cpu", "fp32")
    return build_model(cfg.model, placement, plan_precision(cfg.precision, CPU), announce=False), cfg, placement


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_emulated_linear_is_the_product_of_the_quantized_operands(fmt):
    w, x, b = torch.randn(48, 64, generator=gen(1)), torch.randn(5, 3, 64, generator=gen(2)), torch.randn(48)
    fmt_ = L.LINEAR_FORMATS.get(fmt, "test")
    table = DispatchTable(CPU, "auto", announce=False)
    layer = L.QuantizedLinear(w, b, fmt_, "rceil", *table.choose(fmt_, 64, 48))
    expected = F.linear(fmt_.fake_quantize(x, "rceil"), fmt_.fake_quantize(w, "rceil"), b)
    assert torch.equal(layer(x), expected)
    assert relative_error(layer(x), F.linear(x, w, b)) < {"fp8": 0.05, "mxfp4": 0.4}.get(fmt, 0.15)


@pytest.mark.parametrize("variant", ["flux", "krea3"])
def test_the_down_projection_quantizes_the_activation_output_it_is_given(variant):
    built, _, _ = _quantized_model("mxfp6", variant)
    ff = built.model.transformer_blocks[0].ff
    x = torch.randn(2, 5, 256, generator=gen(14))
    hidden = ff.net[0].proj(x)
    assert torch.equal(ff(x), ff.net[2](ff.activation(hidden)))  # the fused call computes the same product
    assert isinstance(ff.net[2], L.QuantizedLinear)


@pytest.mark.parametrize("fmt, backend", [("fp8", "emulation"), ("fp8", "fp8_rowwise"), ("mxfp6", "emulation")])
def test_a_prefix_and_an_activation_join_inside_the_linear(fmt, backend):
    """proj_out(hidden, activation, prefix) is proj_out([prefix | activation(hidden)]) on every backend."""
    if backend != "emulation" and not hasattr(torch, "_scaled_mm"):
        pytest.skip("no torch._scaled_mm")
    f = L.LINEAR_FORMATS.get(fmt, "test")
    layer = L.QuantizedLinear.with_backend(torch.randn(40, 96, generator=gen(15)) / 8, f, backend)
    prefix, hidden = torch.randn(2, 5, 32, generator=gen(16)), torch.randn(2, 5, 64, generator=gen(17))
    want = layer(torch.cat([prefix, gelu_activation(hidden)], dim=-1))
    assert torch.equal(layer(hidden, activation=gelu_activation, prefix=prefix), want)


@pytest.mark.parametrize("variant", ["flux", "krea3"])
def test_stacked_projections_equal_separate_quantized_ones(variant):
    built, cfg, placement = _quantized_model("fp8", variant)
    attn = built.model.transformer_blocks[0].attn
    assert set(attn.stacked) == {"image", "text"} and attn.to_q is None
    plain = build_model(cfg.model, placement).model.transformer_blocks[0].attn
    x = torch.randn(2, 5, 256, generator=gen(3))
    fmt = L.LINEAR_FORMATS.get("fp8", "test")
    stacked = attn.project(x)
    # Q and K are normalised per head after projection (the plain model's norms hold the same seeded weights); V is not.
    for got, linear, norm in zip(stacked, [plain.to_q, plain.to_k, plain.to_v], [plain.norm_q, plain.norm_k, None]):
        want = F.linear(fmt.fake_quantize(x, "rceil"), fmt.fake_quantize(linear.weight, "rceil"), linear.bias)
        want = want.unflatten(-1, got.shape[-2:])
        want = norm(want) if norm is not None else want
        assert relative_error(got, want) < 1e-5  # fp32 rounding of the same products, summed in another order
    want_v = F.linear(fmt.fake_quantize(x, "rceil"), fmt.fake_quantize(plain.to_v.weight, "rceil"), plain.to_v.bias)
    assert torch.allclose(stacked[2].flatten(2), want_v, rtol=1e-6, atol=1e-6)
    assert (stacked[3] is None) == (variant == "flux")


def test_a_preset_whose_fast_pieces_cannot_run_here_says_so_once_and_records_what_ran(capsys):
    """fp8_all on the CPU: its named GEMM backend and cuDNN's FP8 attention cannot run, so each says so in one
    line (three fp8 components, one line), and the record names the emulation and the reference."""
    cfg = tiny_config("precision=fp8_all")
    built = build_model(cfg.model, select_device_dtype("cpu", "fp32"), plan_precision(cfg.precision, CPU))
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "precision.backend=fp8_rowwise_fast" in line] == [
        "ditrun: precision.backend=fp8_rowwise_fast needs torch._scaled_mm rowwise FP8 (sm89+, MI300+) here; fp8 runs "
        "emulation."
    ]
    assert [line for line in lines if "precision.attention=fp8_pv" in line] == [
        "ditrun: precision.attention=fp8_pv runs as the torch reference here (needs a GPU (cuDNN's FP8 SDPA on NVIDIA "
        "sm_90+, AITER on AMD gfx950))."
    ]
    assert built.details["mlp"]["backends"] == ["emulation"] and built.details["attention"]["backends"] == ["emulation"]


@pytest.mark.slow
def test_bf16_precision_leaves_the_model_alone_and_quantized_models_stay_close():
    built, cfg, placement = _quantized_model("bf16")
    assert not any(isinstance(m, L.QuantizedLinear) for m in built.model.modules())
    assert built.attention is sdpa_attention
    for precision, *attention in [("fp8",), ("krea",), ("fp8", "precision.attention=fp8_pv")]:
        quantized, _, _ = _quantized_model(precision, "flux", *attention)
        assert quantized.details["mlp"]["backends"] == ["emulation"]
        # the presets' attention is SDPA (fp8) or INT8-QK (krea); no quantized attention runs fast on the CPU
        assert quantized.details["attention"]["backends"] == [
            "sdpa" if precision == "fp8" and not attention else "emulation"
        ]
        hidden = torch.randn(1, 6, 64, generator=gen(4))
        inputs = dict(
            hidden_states=hidden,
            encoder_hidden_states=torch.randn(1, 3, 64, generator=gen(5)),
            pooled_projections=torch.randn(1, 32, generator=gen(6)),
            timestep=torch.tensor([0.5]),
            img_ids=torch.zeros(6, 3),
            txt_ids=torch.zeros(3, 3),
            guidance=torch.tensor([3.5]),
        )
        want = built.model(**inputs)
        got = quantized.model(**inputs, attention=quantized.attention)
        assert 0 < relative_error(got, want) < 0.1


# ---------------------------------------------------------------------------------------------
# The fast quantizers (plain arithmetic) against the exact codecs; they run on the CPU too


@pytest.mark.parametrize("element", [e for e in formats.FORMATS])
def test_arithmetic_rounding_equals_the_codec_on_every_midpoint(element):
    fmt = formats.FORMATS[element]
    values = formats.finite_values(fmt)
    mids = (values[:-1] + values[1:]) / 2
    x = torch.cat([values, mids, -mids, torch.nextafter(mids, torch.zeros_like(mids)), values * 1.7, values * 9])
    x = torch.cat([x, torch.randn(4000, generator=gen(7)) * fmt.max_value / 3])
    expected = formats.decode(formats.encode(x, fmt), fmt)
    assert torch.equal(formats.round_to_grid(x, fmt), expected)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4"])
def test_mx_repack_to_fp8_is_exact_unless_counted(fmt):
    f = L.LINEAR_FORMATS.get(fmt, "test")
    x = torch.randn(64, 128, generator=gen(8))
    x[:8, :32] *= 2.0**24  # a block 24 binades above the others: their small values fall below E4M3's range
    fp8, scale, inexact = L.mx_repack_fp8(x, f.element, 32, "rceil")
    assert scale.shape == (64, 1) and torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    got = fp8.float() * scale
    want = f.fake_quantize(x, "rceil")
    exact_rows = (got == want).all(dim=1)
    assert int(inexact) == int((~exact_rows).sum())
    assert exact_rows[8:].all()  # ordinary rows (one binade of spread) repack exactly
    if fmt != "mxfp8":
        assert int(inexact) > 0


def _compiled_whole(fn):
    """fn through torch.compile with fullgraph=True (a graph break raises) and dynamic shapes, as on GPUs;
    the eager backend: dynamo traces with fake tensors as for inductor, without compiling C++ on the CPU."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, bit for bit (one-byte types, FP4 pairs and E8M0 included, compare as bytes)."""
    if a.dtype.itemsize == 1:
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, fmt",
    [
        ("emulation", "fp8"),
        ("emulation", "mxfp6"),
        ("fp8_rowwise", "fp8"),
        ("mx_repack_fp8", "mxfp8"),
        ("mx_repack_fp8", "mxfp6"),
        ("mx_repack_fp8", "mxfp4"),
        ("mx_scaled_mm", "mxfp8"),
        ("mx_scaled_mm", "mxfp4"),
    ],
)
def test_activation_quantizers_compile_without_graph_breaks(backend, fmt):
    fmt = L.LINEAR_FORMATS.get(fmt, "fmt")
    quantize = type(L.LINEAR_BACKENDS.get(backend, "backend")()).quantize
    x = torch.randn(48, 256, generator=gen(3)) * 3

    def fn(x):
        return quantize(x, fmt, "rceil")

    for got, want in zip(_compiled_whole(fn)(x), fn(x)):
        assert _same_bits(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("v_format", ["bf16", "fp8", "mxfp6"])
def test_attention_operand_quantization_compiles_without_graph_breaks(v_format):
    from ditrun.kernels.attention import operand_tensors

    q, k, v = _qkv(s=64)
    for got, want in zip(_compiled_whole(operand_tensors)(q, k, v, v_format), operand_tensors(q, k, v, v_format)):
        assert torch.equal(got, want)


def test_rowwise_fp8_quantizer_matches_the_codec():
    x = torch.randn(32, 64, generator=gen(9)) * 5
    fp8, scale = L.quantize_rowwise_fp8(x, torch.float8_e4m3fn)
    codes, ref_scale = formats.quantize_fp8(x)
    assert torch.equal(scale, ref_scale) and torch.equal(fp8.view(torch.uint8), codes)


# ---------------------------------------------------------------------------------------------
# INT8-QK attention


def _qkv(b=1, s=300, h=2, d=64, seed=10):
    g = gen(seed)
    return [torch.randn(b, s, h, d, generator=g) for _ in range(3)]


@pytest.mark.parametrize("name", ["int8qk", "int8qk_fp8v", "int8qk_mxfp6v", "fp8_pv"])
def test_quantized_attention_is_close_to_sdpa(name):
    q, k, v = _qkv()
    k = k + 3.0  # a large mean over tokens: smoothing removes it before quantizing
    got = ATTENTION_KERNELS.get(name).make("emulation")(q, k, v)
    assert relative_error(got, sdpa_attention(q, k, v)) < {"int8qk": 0.02, "fp8_pv": 0.1}.get(name, 0.05)


def test_fp8_pv_rounds_p_and_scales_per_tensor():
    """The recipe, worked by hand: one query row, keys whose probabilities E4M3 cannot all hold."""
    q8 = torch.tensor([[[[2.0, 0.0]]]]).to(torch.float8_e4m3fn)  # [B=1, S=1, H=1, D=2]
    scores = torch.tensor([0.0, -1.0, -2.5, -6.0])  # wanted q.k * sm_scale with sm_scale = 1
    k8 = torch.stack([scores / 2 / 0.5, torch.zeros(4)], dim=-1)[None, :, None].to(torch.float8_e4m3fn)
    v8 = torch.tensor([1.0, 2.0, 4.0, 8.0])[None, :, None, None].expand(1, 4, 1, 2).to(torch.float8_e4m3fn)
    scales = torch.tensor([1.0, 0.5, 0.25, 2.0])  # Q, K, V, output (1 / (2 * V's))
    out = fp8_pv_emulation(q8, k8, v8, scales, 1.0).float() / 2.0
    p = torch.exp(scores)
    p8 = formats.round_to_grid(p * P_SCALE, "fp8_e4m3") / P_SCALE
    assert not torch.equal(p8, p)  # P is rounded (exp(-1) = 0.368 -> 0.375)
    mean = (p8 * torch.tensor([1.0, 2.0, 4.0, 8.0])).sum() / p.sum()  # in V's codes
    want = formats.round_to_grid(mean / 2, "fp8_e4m3") * 2 * 0.25  # the output in E4M3 at scale 2 * V's
    assert formats.round_to_grid(mean / 2, "fp8_e4m3") != mean / 2
    assert torch.allclose(out, want.expand(1, 1, 1, 2), rtol=1e-6)
    q, k, v = _qkv(s=50)
    *codes, tensor_scales = fp8_pv_operands(q, k * 100, v)
    assert tensor_scales.shape == (4,) and torch.equal(tensor_scales.log2(), tensor_scales.log2().round())
    assert tensor_scales[1] >= 64 * tensor_scales[0]  # one power-of-two scale per tensor, from its own amax
    assert tensor_scales[3] * tensor_scales[2] == 0.5
    assert all(c.dtype == torch.float8_e4m3fn and c.shape == q.shape for c in codes)
    exact = formats.round_to_grid(q / tensor_scales[0], "fp8_e4m3")  # the cast rounds as the codec does
    assert torch.equal(codes[0].float(), exact)


def test_fp8_pv_op_attends_within_the_recipes_rounding_off_the_gpu_and_compiles():
    q, k, v = _qkv(s=40)
    operands = fp8_pv_operands(q, k, v)
    got = fp8_sdpa_op(*operands, 0.125)
    assert got.dtype == torch.float8_e4m3fn and _fp8_pv_within_rounding(got.float() / operands[3][3], operands, 0.125)
    # aot_eager traces through the fake implementation as inductor would, without compiling C++
    compiled = torch.compile(lambda *a: fp8_sdpa_op(*a, 0.125).float(), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*operands), got.float())


def test_int8qk_is_independent_of_the_order_of_tokens():
    """Per-token scales: a layout that gathers the sequence in another order gets the same rows."""
    q, k, v = _qkv(s=70)
    perm = torch.randperm(70, generator=gen(11))
    attention = ATTENTION_KERNELS.get("int8qk_mxfp6v").make("emulation")
    out = attention(q, k, v)
    out_perm = attention(q[:, perm], k[:, perm], v[:, perm])
    assert torch.allclose(out_perm, out[:, perm], rtol=1e-5, atol=1e-6)


def test_the_custom_op_is_attention_of_the_dequantized_operands_and_compiles():
    q, k, v = _qkv(s=40)
    ops = quantize_operands(q, k, v, "bf16")
    args = (ops.q, ops.q_scale, ops.k, ops.k_scale, ops.v, 0.125, "triton")
    want = _attention64(ops.q * ops.q_scale[..., None], ops.k * ops.k_scale[..., None], ops.v, 0.125)
    assert relative_error(int8qk_attention_op(*args).double(), want) < 1e-5  # fp32 sums of exact products
    torch.library.opcheck(int8qk_attention_op, args, test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# The attention formats' quantizers against their definitions


def _attention64(q, k, v, sm_scale):
    """Attention in fp64 of [B, H, S, D] operands."""
    q, k, v = (t.double() for t in (q, k, v))
    return torch.softmax(q @ k.transpose(-1, -2) * sm_scale, dim=-1) @ v


def _smoothed(k, dim):
    """k minus its fp64 mean over the tokens (``dim``)."""
    return k - k.double().mean(dim=dim, keepdim=True).to(k.dtype)


def test_int8_rows_have_a_scale_per_token_and_round_to_nearest():
    x = torch.randn(2, 3, 20, 16, generator=gen(12)) * torch.linspace(0.01, 50, 20)[:, None]
    x[1, 2, 7] = 0.0
    codes, scale = quantize_int8_rows(x)
    amax = x.double().abs().amax(dim=-1)
    want = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).float()  # 127, not 128: +-amax both fit
    assert codes.dtype == torch.int8 and scale.shape == (2, 3, 20) and torch.equal(scale, want)
    assert torch.equal(codes.abs().amax(dim=-1)[amax > 0], torch.full_like(amax[amax > 0], 127, dtype=torch.int8))
    err = (x.double() - codes.double() * scale.double()[..., None]).abs()
    assert (err <= scale.double()[..., None] * (0.5 + 1e-6)).all()  # nearest code (fp32 division: 1e-6)


@pytest.mark.parametrize("v_format", ["bf16", "fp8", "mxfp6"])
def test_int8qk_operands_follow_the_definition(v_format):
    q, k, v = _qkv(b=2, s=24, h=3, d=32, seed=13)
    k = k * torch.linspace(0.5, 4, 3)[:, None] + 2.0  # heads of different ranges, a mean to remove
    v = v * torch.tensor([1.0, 1 / 16, 300.0])[:, None]
    ops = quantize_operands(q, k, v, v_format)
    for got, got_scale, x in ((ops.q, ops.q_scale, q), (ops.k, ops.k_scale, _smoothed(k, 1))):
        x = x.transpose(1, 2)  # [B, H, S, D]
        torch.testing.assert_close(got_scale, x.abs().amax(dim=-1) / 127, rtol=1e-6, atol=0)
        assert ((got * got_scale[..., None] - x).abs() <= got_scale[..., None] * (0.5 + 1e-5)).all()
    v = v.transpose(1, 2)
    if v_format == "bf16":
        assert torch.equal(ops.v, v)
    elif v_format == "fp8":  # one power-of-two scale per head, the smallest that holds the head's amax
        scale = torch.exp2(torch.ceil(torch.log2(v.double().abs().amax(dim=(-2, -1)) / 448))).float()[..., None, None]
        values = ops.v / scale
        assert torch.equal(formats.decode(formats.encode(values, "fp8_e4m3"), "fp8_e4m3"), values)  # on the grid
        assert (values.abs().amax(dim=(-2, -1)) <= 448).all() and (values.abs().amax(dim=(-2, -1)) > 224).all()
        assert ((ops.v - v).abs() <= scale * torch.maximum(v.abs() / scale / 16, torch.tensor(2.0**-10))).all()
    else:
        assert torch.equal(ops.v, formats.dequantize_mx(*formats.quantize_mx(v, "fp6_e2m3"), "fp6_e2m3"))


@pytest.mark.parametrize("name", ["int8qk", "int8qk_fp8v", "int8qk_mxfp6v"])
def test_int8qk_attention_is_fp64_attention_of_its_operands(name):
    """The scores' scales and the softmax scale applied as defined, to 1e-5 (fp32 arithmetic on exact products); against
    attention of the unquantized inputs, within what the rounding of Q and K can move a score: each |dq| <= s_q / 2,
    |dk| <= s_k / 2, so |ds| <= sm * sum_d (|q_d| s_k + |k_d| s_q + s_q s_k / 2) / 2 = delta, the probabilities move
    by a factor within exp(+-2 delta), and the output by at most (exp(2 delta) - 1) max |v| (plus V's own rounding)."""
    q, k, v = _qkv(b=1, s=64, h=2, d=32, seed=14)
    k = k + 3.0
    v_format = {"int8qk": "bf16", "int8qk_fp8v": "fp8", "int8qk_mxfp6v": "mxfp6"}[name]
    ops = quantize_operands(q, k, v, v_format)
    sm = 32**-0.5
    got = ATTENTION_KERNELS.get(name).make("emulation")(q, k, v).transpose(1, 2).double()  # [B, H, S, D]
    deq = _attention64(ops.q * ops.q_scale[..., None], ops.k * ops.k_scale[..., None], ops.v, sm)
    assert relative_error(got, deq) < 1e-5
    qd, kd = q.transpose(1, 2).double(), _smoothed(k, 1).transpose(1, 2).double()
    sq, sk = ops.q_scale.double()[..., :, None], ops.k_scale.double()[..., None, :]  # [B, H, Sq, 1], [B, H, 1, Sk]
    q_sum, k_sum = qd.abs().sum(-1)[..., :, None], kd.abs().sum(-1)[..., None, :]
    delta = sm * (q_sum * sk + sq * k_sum + sq * sk * qd.shape[-1] / 2) / 2  # [B, H, Sq, Sk]
    bound = (torch.exp(2 * delta.amax(dim=-1, keepdim=True)) - 1) * v.abs().max()
    want = _attention64(qd, kd, ops.v, sm)  # V's rounding is the format's, checked above
    assert ((got - want).abs() <= bound).all()
    assert ((got - _attention64(q.transpose(1, 2), k.transpose(1, 2), ops.v, sm)).abs() <= bound + 1e-9).all()


@pytest.mark.parametrize("name", ["int8qk", "int8qk_fp8v", "int8qk_mxfp6v"])
def test_int8qk_attention_keeps_bf16_and_is_the_same_in_query_chunks(name):
    q, k, v = (t.bfloat16() for t in _qkv(b=1, s=40, h=2, d=32, seed=17))
    got = ATTENTION_KERNELS.get(name).make("emulation")(q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ops = quantize_operands(q, k, v, {"int8qk": "bf16", "int8qk_fp8v": "fp8", "int8qk_mxfp6v": "mxfp6"}[name])
    want = _attention64(ops.q * ops.q_scale[..., None], ops.k * ops.k_scale[..., None], ops.v, 32**-0.5)
    assert relative_error(got.transpose(1, 2).double(), want) < 2**-8  # the output rounded to BF16
    chunked = int8qk_emulation(ops, 32**-0.5, chunk=7)  # 5 chunks of 7 query rows and one of 5
    assert relative_error(chunked.double(), want) < 2**-8


def test_fp8_pv_scales_are_powers_of_two_per_tensor():
    amax = torch.tensor([3.0, 448.0, 0.01]), torch.tensor([100.0, 1.0, 2.0]), torch.tensor([12.0, 0.5, 0.0])
    amax_v = torch.tensor([1.0, 900.0, 448.0])
    got = fp8_pv_scales(*amax, amax_v).double()
    for i in range(3):
        fits = [amax[0][i].item(), (amax[1][i] + amax[2][i]).item(), amax_v[i].item()]
        want = [2.0 ** math.ceil(math.log2(a / 448)) for a in fits]
        assert got[i].tolist() == [*want, 0.5 / want[2]]


def test_fp8_pv_operands_are_the_e4m3_codes_of_q_smoothed_k_and_v():
    q, k, v = _qkv(b=2, s=30, seed=15)
    k = k * 3 + 5.0
    q8, k8, v8, scales = fp8_pv_operands(q, k, v)
    smoothed = k.double() - k.double().mean(dim=1, keepdim=True)
    mean_amax = k.double().mean(dim=1).abs().amax()
    want = [2.0 ** math.ceil(math.log2(a / 448)) for a in (q.abs().amax(), k.abs().amax() + mean_amax, v.abs().amax())]
    assert scales.double().tolist() == [*want, 0.5 / want[2]]
    for codes, x, s in ((q8, q.double(), want[0]), (k8, smoothed, want[1]), (v8, v.double(), want[2])):
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
        e4m3 = formats.FORMATS["fp8_e4m3"]
        bound = torch.maximum(x.abs() / 16, torch.tensor(2.0 ** (1 - e4m3.bias - e4m3.mantissa_bits) / 2 * s))
        assert ((codes.double() * s - x).abs() <= bound * (1 + 1e-6)).all()  # nearest E4M3 (K's mean in fp32)


def _fp8_pv_within_rounding(got, operands, sm_scale) -> bool:
    """Attention output [B, S, H, D] of ``fp8_pv_operands`` against fp64 attention of the dequantized operands: P * 256
    rounded to E4M3 moves each probability by at most p / 16 + 2^-10 / 256 (a relative half step, or half a
    subnormal step), so the output (divided by the row sum, >= 1) by at most e = (1/16 + S 2^-18) max |v|; its E4M3
    rounding at scale 2 * V's adds (|o| + e) / 16 + 2^-10 * 2 s_v."""
    q8, k8, v8, scales = operands
    deq = [(c.double() * s).transpose(1, 2) for c, s in ((q8, scales[0]), (k8, scales[1]), (v8, scales[2]))]
    want = _attention64(*deq, sm_scale)
    e = (1 / 16 + k8.shape[1] * 2.0**-18) * deq[2].abs().max()
    bound = e + (want.abs() + e) / 16 + 2.0**-10 * 2 * scales[2].double()
    return bool(((got.transpose(1, 2).double() - want).abs() <= bound).all())


def test_fp8_pv_attention_is_within_the_rounding_of_p_and_the_output():
    q, k, v = _qkv(s=48, h=2, d=32, seed=16)
    q[:, 0] *= 10  # a row whose largest score is far above the others': each row's P is scaled by its own maximum
    operands = fp8_pv_operands(q, k, v)
    sm = 32**-0.5
    got = attend_fp8_pv(*operands, "emulation", torch.float32)
    assert _fp8_pv_within_rounding(got, operands, sm)
    assert _fp8_pv_within_rounding(fp8_pv_emulation(*operands, sm, chunk=7).float() / operands[3][3], operands, sm)
    assert attend_fp8_pv(*operands, "emulation", torch.bfloat16).dtype == torch.bfloat16
    assert ATTENTION_KERNELS.get("fp8_pv").make("emulation")(*(t.bfloat16() for t in (q, k, v))).dtype == torch.bfloat16
    deq = [(c.double() * s).transpose(1, 2) for c, s in zip(operands[:3], operands[3])]
    want = _attention64(*deq, sm)
    got = got.transpose(1, 2).double()
    assert relative_error(got, want) > 1e-4  # P and the output are rounded: not fp32 attention


# ---------------------------------------------------------------------------------------------
# Fast linear backends against the emulation


@pytest.mark.parametrize(
    "fmt, backend",
    [("fp8", "fp8_rowwise"), ("mxfp8", "mx_repack_fp8"), ("mxfp6", "mx_repack_fp8"), ("mxfp4", "mx_repack_fp8")],
)
def test_fast_backend_arithmetic_on_the_cpu_scaled_mm(fmt, backend):
    """The GPU backends' own code, run through torch._scaled_mm's CPU implementation (fp32 out)."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("no torch._scaled_mm")
    f = L.LINEAR_FORMATS.get(fmt, "test")
    w, x = torch.randn(48, 128, generator=gen(12)) / 8, torch.randn(70, 128, generator=gen(13))
    fast = L.QuantizedLinear.with_backend(w, f, backend)
    got = fast(x)
    want = L.QuantizedLinear.with_backend(w, f, "emulation")(x)
    # MX repack is exact: the same products, summed in another order; FP8 rowwise rounds x/scale the same way.
    assert relative_error(got, want) < 1e-5
    if backend == "mx_repack_fp8":
        counts = fast.backends[backend].inexact_rows
        assert counts["weight"] == 0 and int(counts["activation"]) == 0
        x[3, :32] *= 2.0**24  # a block far above the rest of its row: that row's repack is inexact
        fast(x), fast(x)
        assert int(counts["activation"]) == 2  # summed in place on the device, call after call


@pytest.mark.gpu
def test_fused_fp8_attention_matches_its_reference():
    """cuDNN's (AITER's) fused FP8 attention against the recipe in torch on the same operands; then the
    whole ``fp8_pv`` attention (compiled operand quantization + kernel), eager and compiled."""
    from ditrun.kernels import fp8_sdpa

    why = fp8_sdpa.unavailable(torch.device("cuda"))
    if why is not None:
        pytest.skip(f"fp8_pv {why}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1000, 4, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    operands = fp8_pv_operands(q, k, v)
    got = fp8_sdpa_op(*operands, 1 / 128**0.5)
    assert got.shape == q.shape and got.dtype == torch.float8_e4m3fn
    # The kernel rounds P against the running maximum, the reference against the row's final one: a few
    # output codes land one or two E4M3 steps apart (seen: max 4.2e-2 of the largest output).
    assert relative_error(got.float(), fp8_pv_emulation(*operands, 1 / 128**0.5).float()) < 6e-2
    fast, reference = (ATTENTION_KERNELS.get("fp8_pv").make(f) for f in (fp8_sdpa.BACKEND, "emulation"))
    want = reference(q, k, v).float()
    assert relative_error(fast(q, k, v).float(), want) < 6e-2
    assert relative_error(torch.compile(fast, fullgraph=True)(q, k, v).float(), want) < 6e-2
    assert relative_error(fast(q, k, v).float(), sdpa_attention(q, k, v).float()) < 0.1


@pytest.mark.gpu
def test_the_fp8_pv_reference_compiles_with_inductor_on_the_gpu():
    """Where no fused FP8 attention runs (no cuDNN frontend), compiled models run the reference through Inductor."""
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 300, 2, 64, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    operands = fp8_pv_operands(q, k, v)
    want = fp8_pv_emulation(*operands, 0.125, chunk=128).float()
    got = torch.compile(lambda *a: fp8_pv_emulation(*a, 0.125, chunk=128).float(), fullgraph=True)(*operands)
    assert relative_error(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_fast_linear_backends_match_the_emulation(fmt):
    device = torch.device("cuda")
    f = L.LINEAR_FORMATS.get(fmt, "test")
    names = L.fast_backends(f, device)
    if not names:
        pytest.skip(f"no fast backend for {fmt} on this GPU")
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(512, 1024, device=device, generator=g).to(torch.bfloat16) / 32
    x = torch.randn(300, 1024, device=device, generator=g).to(torch.bfloat16)
    bias = torch.randn(512, device=device, generator=g).to(torch.bfloat16)

    def linear(name, b=None):  # the model's path: compiled quantizer; the FP8 backends add a bias in the GEMM
        return L.QuantizedLinear(w, b, f, "rceil", {name: L.LINEAR_BACKENDS.get(name, "test")()}, lambda m: name)

    want, want_biased = (linear("emulation", b)(x).float() for b in (None, bias))
    for name in names:
        assert relative_error(linear(name)(x).float(), want) < 2e-2, name
        assert relative_error(linear(name, bias)(x).float(), want_biased) < 2e-2, name


# ---------------------------------------------------------------------------------------------
# The dispatch table


def test_dispatch_table_round_trip_and_untuned_shapes_say_so_once(tmp_path, capsys):
    fmt = L.LINEAR_FORMATS.get("mxfp6", "test")
    table = DispatchTable(CPU, "auto")
    table.entries[entry_key("mxfp6", 300, 64, 48, "cpu")] = "emulation"
    table.save(tmp_path / "d.json")
    loaded = DispatchTable.load(tmp_path / "d.json", CPU)
    assert loaded.tuned(fmt, 64, 48) == {512: "emulation"} and m_bucket(300) == 512 and m_bucket(3) == 16
    backends, pick = loaded.choose(fmt, 64, 48)
    assert list(backends) == ["emulation"] and pick(400) == "emulation" and pick(5) == "emulation"
    assert capsys.readouterr().out == ""  # one candidate on a CPU: nothing to tune, nothing to say
    assert DispatchTable(CPU, "emulation").candidates(L.LINEAR_FORMATS.get("fp8", "t")) == ["emulation"]


@pytest.mark.slow
def test_tune_saves_a_choice_per_real_shape_that_later_builds_load(tmp_path, capsys):
    from ditrun.tune import tune

    cfg = tiny_config("precision=fp8", "model.variant=krea3", f"precision.tuning_file={tmp_path / 'dispatch.json'}")
    tune(cfg)
    assert f"dispatch table: {tmp_path / 'dispatch.json'}" in capsys.readouterr().out
    table = DispatchTable.load(tmp_path / "dispatch.json", CPU)
    fmt = L.LINEAR_FORMATS.get("fp8", "test")
    assert table.tuned(fmt, 256, 2048) and table.tuned(fmt, 1024, 256)  # the SwiGLU MLP's up and down projections
    assert set(table.entries.values()) == {"emulation"}
    assert all("|cpu|torch " in key for key in table.entries)
