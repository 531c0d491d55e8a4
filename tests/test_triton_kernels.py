"""The Triton kernels against their torch references: the activation quantizers
(kernels/quantize_triton.py) equal the FP8 backends' torch quantizers, and the INT8-QK attention
kernel (kernels/attention_triton.py) equals ``int8qk_emulation``: in Triton's CPU interpreter
(where Triton is installed: the arithmetic) and on a GPU (bit for bit with the FP8 casts)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import relative_error

from ditrun.kernels import formats
from ditrun.kernels import linear as L
from ditrun.kernels.attention import int8qk_attention_op, int8qk_emulation, quantize_operands

ELEMENTS = ["fp8_e4m3", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"]


def activation(device: str = "cpu") -> torch.Tensor:
    """[8, 320] bf16 spanning six decades across K, with a zero row, a zero block and a ragged last tile."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 320, generator=g) * torch.logspace(-3, 3, 320)
    x[1], x[2, :64] = 0, 0
    x[3, :32] *= 2.0**24  # a block far above the rest of its row: the row's repack is inexact
    return x.to(torch.bfloat16).to(device)


def long_activation(device: str = "cpu") -> torch.Tensor:
    """[3, 16448] bf16: rows of many of the quantizers' 1024-element tiles (``activation()`` fits in one),
    with a ragged last tile."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, 16448, generator=g) * torch.logspace(-2, 2, 16448)).to(torch.bfloat16).to(device)


def tilings(x: torch.Tensor) -> list:
    """The quantizers' tilings to check on x: every candidate on short rows (both loops and whole rows in registers,
    several rows per program with a ragged last program, tiles shorter than one row); on long rows the default, a
    multi-row loop and the whole row at once."""
    import triton

    from ditrun.kernels import quantize_triton as T

    k = x.shape[1]
    if k <= 1024:
        return T.candidate_tilings(k) + [T.Tiling(4, 64, 4)]
    return [
        T.default_tiling(k, "fp8"),
        T.default_tiling(k, "mx"),
        T.Tiling(2, 1024, 8),
        T.Tiling(1, triton.next_power_of_2(k), 16, True),
    ]


def interpreted_tilings(x: torch.Tensor) -> list:
    """``tilings(x)`` as the interpreter runs them: a program's arithmetic is the same on any number of warps, so
    tilings that differ only in warps are one case here (the GPU test times and checks each)."""
    distinct = {}
    for tiling in tilings(x):
        distinct.setdefault((tiling.rows, tiling.tile, tiling.one_tile), tiling)
    return list(distinct.values())


def check_arithmetic(store_dtype=torch.float32) -> None:
    """Every quantizer's values before the FP8 cast, cast by torch, equal the torch reference's codes, and the MX
    repack counts the rows the reference counts inexact, in every tiling of ``interpreted_tilings``: MX for one
    element format and rule in each (the tile code is the same for all), every format and rule in a looped
    tiling, in tiles shorter than the row and held in one tile."""
    from ditrun.kernels import quantize_triton as T

    for x in (activation(), long_activation()):
        long_rows = x.shape[1] > 1024
        walks = interpreted_tilings(x)
        every_format = [next(t for t in walks if not t.one_tile), next(t for t in walks if t.one_tile)]
        every_format += [t for t in walks if not t.one_tile and t.tile < x.shape[1]][-1:]
        for tiling in walks:
            got, scale = T.rowwise_fp8(x, torch.float8_e4m3fn, store_dtype, tiling)
            want, want_scale = L.quantize_rowwise_fp8(x, torch.float8_e4m3fn)
            assert torch.equal(scale, want_scale) and torch.equal(got.to(torch.float8_e4m3fn).float(), want.float())
            for element in ELEMENTS:
                if (long_rows or tiling not in every_format) and element != "fp6_e2m3":
                    continue  # the tile loop is the same code for every element format: one suffices
                for mode in ["rceil"] if long_rows or tiling not in every_format else formats.SCALE_MODES:
                    headroom = L.repack_headroom(formats.FORMATS[element])
                    got, scale, inexact = T.mx_repack_fp8(x, element, 32, mode, headroom, store_dtype, tiling)
                    want, want_scale, want_inexact = L.mx_repack_fp8(x, element, 32, mode)
                    assert torch.equal(scale, want_scale), (element, mode, tiling)
                    assert torch.equal(got.to(torch.float8_e4m3fn).float(), want.float()), (element, mode, tiling)
                    assert int(inexact) == int(want_inexact), (element, mode, tiling)


def check_joined_quantizer(device: str = "cpu", store_dtype=torch.float32) -> None:
    """``rowwise_fp8`` of [prefix | GELU(x)] (a single block's down projection input, rows strided as a split of the
    stacked projection's output) equals the torch quantizer of the joined rows computed as a compiled block does
    (``gelu_activation``'s sigmoid form in fp32, rounded to bf16): the scales and every code, in looped tilings of
    several sizes; without a prefix too, and a prefix alone. A kernel that skipped the activation's rounding, mixed
    up the prefix and hidden columns, or took the amax over one part only differs in codes or scales."""
    from ditrun.kernels import quantize_triton as T
    from ditrun.model.dit import GELU_TANH_COEFF, SQRT_2_OVER_PI

    def gelu(h):
        x = h.float()
        return (x * torch.sigmoid((2.0 * SQRT_2_OVER_PI) * (x + GELU_TANH_COEFF * x * x * x))).to(h.dtype)

    g = torch.Generator().manual_seed(21)
    stacked = (torch.randn(37, 96 + 2080, generator=g) * 3).to(torch.bfloat16).to(device)  # [attention | hidden]
    hidden = stacked[:, 96:]  # strided rows, as the split of a stacked output
    prefix = (torch.randn(37, 160, generator=g) * 20).to(torch.bfloat16).to(device)
    prefix[5] *= 1e-3  # a row whose amax is the activation's
    hidden[7] *= 1e-3  # and one whose amax is the prefix's
    hidden[9] = -hidden[9].abs()  # all below 0: the activation's amax is not that of the row's largest x
    hidden[11] = hidden[11].abs() * 0.1  # all small: the largest x's activation is below GELU_BOUND
    cases = [(prefix, "gelu_tanh"), (None, "gelu_tanh"), (prefix, None)]
    for tiling in (T.joined_tiling(2080), T.Tiling(2, 512, 4), T.Tiling(1, 128, 4), T.Tiling(1, 4096, 16, True)):
        for pre, activation in cases:
            got, scale = T.rowwise_fp8(hidden, torch.float8_e4m3fn, store_dtype, tiling, activation, pre)
            joined = hidden if activation is None else gelu(hidden)
            joined = joined if pre is None else torch.cat([pre, joined], dim=1)
            want, want_scale = L.quantize_rowwise_fp8(joined, torch.float8_e4m3fn)
            case = (tiling, activation, pre is None)
            if device == "cpu":  # the interpreter divides exactly: bit for bit
                assert torch.equal(scale, want_scale), case
                assert torch.equal(got.to(torch.float8_e4m3fn).float(), want.float()), case
                continue
            # GPUs: the activation's fast quotient (2 ulp of fp32) moves its bf16 rounding now and then: a scale by
            # a bf16 step at most, and a code by one E4M3 step in a few elements
            assert torch.allclose(scale, want_scale, rtol=2**-7, atol=0), case
            got, want = got.float() * scale, want.float() * want_scale
            gap = (got - want).abs()
            assert (gap > 2**-7 * want.abs()).float().mean() < 1e-3, case
            assert bool((gap <= 2**-3 * want.abs() + 2**-8 * want_scale).all()), case  # a step, subnormals too


def check_counted_repack(device: str = "cpu") -> None:
    """``ditrun::mx_repack_fp8_counted`` adds each call's inexact rows to the running count it is given (the kernel's
    atomics), and its schema and fake hold (opcheck: the count is declared mutated)."""
    x = activation(device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    for calls in (1, 2):
        codes, scale = L.mx_repack_fp8_counted_op(x, "fp6_e2m3", 32, "rceil", count)
        want, want_scale, want_inexact = L.mx_repack_fp8(x, "fp6_e2m3", 32, "rceil")
        assert torch.equal(scale, want_scale) and int(count) == calls * int(want_inexact) > 0
    torch.library.opcheck(L.mx_repack_fp8_counted_op, (x, "fp6_e2m3", 32, "rceil", count))


def check_attention() -> None:
    """The attention kernel with fixed tiles (the interpreter cannot autotune), BF16-path V, masked and not."""
    from ditrun.kernels.attention_triton import flash_attention

    for s in (200, 256):  # 200: the last key tile is masked; 256: every tile is full
        g = torch.Generator().manual_seed(s)
        ops = quantize_operands(*(torch.randn(1, s, 2, 64, generator=g) for _ in range(3)), "bf16")
        got = flash_attention(
            ops.q, ops.q_scale, ops.k, ops.k_scale, ops.v, 0.125, config={"BLOCK_M": 64, "BLOCK_N": 64}
        )
        assert relative_error(got, int8qk_emulation(ops, 0.125)) < 1e-5


def check_qk_quantizer(dtype=torch.float32) -> None:
    """The fused Q/K quantizer equals quantize_int8_rows of the (smoothed) transposed input. fp32 in the
    interpreter, whose casts to BF16 truncate; BF16 on GPUs."""
    from ditrun.kernels.attention import quantize_int8_rows, quantize_qk_op, smooth_k

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 100, 3, 64, generator=g) + 0.5 * torch.randn(2, 1, 3, 64, generator=g)  # a key bias
    x[0, 5] = 0
    x = x.to(dtype).to("cuda" if dtype != torch.float32 else "cpu")
    for smooth in (False, True):
        got = quantize_qk_op(x, smooth)
        want = quantize_int8_rows((smooth_k(x, dim=1) if smooth else x).transpose(1, 2))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), smooth


@pytest.mark.timeout(240)
def check_v_codes(device: str = "cpu") -> None:
    """The FP8 P @ V's V operand made by two Triton passes (``attention_triton.fp8_v_codes``: the heads' amax, then
    the codes; behind ``attention.fp8_v_codes_op`` and ``attention_gluon.fp8_v_operand``) equals its torch statement
    (``attention.fp8_v_codes``): E4M3 codes of V^T, keys reordered within 32, zeros past S, and the scale per head;
    for V as the model hands it ([B, S, H, D], unquantized) and FP8-exact V as a [B, H, S, D] view; S even, uneven
    and below 32. The interpreter's E4M3 casts flush subnormals and do not round as the GPU does: there, FP8-exact V
    and normal codes only."""
    from ditrun.kernels.attention import _gluon_kernels, fp8_v_codes, fp8_v_codes_op, quantize_v
    from ditrun.kernels.attention_triton import fp8_v_codes as triton_fp8_v_codes

    gluon = _gluon_kernels()
    g = torch.Generator().manual_seed(1)
    for s in (96, 100, 17):
        v = (3 * torch.randn(2, s, 3, 128, generator=g)).to(device, torch.bfloat16)  # [B, S, H, D]
        fp8_exact = quantize_v(v.transpose(1, 2), "fp8")  # [B, H, S, D]
        made = [(triton_fp8_v_codes(fp8_exact.transpose(1, 2)), fp8_v_codes(fp8_exact))]
        if device != "cpu":
            made.append((triton_fp8_v_codes(v), fp8_v_codes(v.transpose(1, 2))))
        if gluon is not None:
            made.append((gluon.fp8_v_operand(fp8_exact), fp8_v_codes(fp8_exact)))
        for (codes, scale), (ref, ref_scale) in made:
            assert codes.shape == ref.shape == (2 * 3 * 128, -(-s // 32) * 32)
            assert torch.equal(scale, ref_scale)
            kept = (ref.float().abs() >= 2**-6) if device == "cpu" else torch.ones_like(ref, dtype=torch.bool)
            assert torch.equal(codes.float()[kept], ref.float()[kept])
    # The custom op compiled graphs call: its schema, and its fake's shapes and dtypes (dynamic ones too).
    torch.library.opcheck(fp8_v_codes_op, (fp8_exact.transpose(1, 2),))


@pytest.mark.slow
def test_triton_kernels_in_the_cpu_interpreter():
    pytest.importorskip("triton")
    # TRITON_INTERPRET is read when kernels are defined: a fresh process. Its FP8 casts are not exact
    # (they flush E4M3 subnormals), so it checks the values before the cast; the GPU test checks the cast.
    code = (
        "import test_triton_kernels as t; t.check_arithmetic(); t.check_attention(); "
        "t.check_qk_quantizer(); t.check_v_codes(); t.check_counted_repack(); t.check_joined_quantizer()"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=200
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_triton_quantizers_equal_the_torch_quantizers_on_the_gpu():
    """Bit for bit, FP8 casts included, in every tiling of ``tilings`` and every one ``gemm.py --tilings`` times for
    the Flux linears' K (MX: every tiling for one element format and rule, which share the tile code, and the
    default and one whole-row tiling for the others); each tiling counts the inexact rows as the default does."""
    from ditrun.kernels import quantize_triton as T

    dtype = L.fp8_dtype()
    g = torch.Generator().manual_seed(3)
    flux = (torch.randn(37, 3072, generator=g) * torch.logspace(-2, 2, 3072)).to(torch.bfloat16).cuda()
    for x in (activation("cuda"), long_activation("cuda"), flux):
        want, want_scale = L.quantize_rowwise_fp8(x, dtype)
        candidates = tilings(x) + (T.candidate_tilings(x.shape[1]) if x is flux else [])
        for tiling in candidates:
            got, scale = T.rowwise_fp8(x, dtype, tiling=tiling)
            assert torch.equal(scale, want_scale) and torch.equal(got.float(), want.float()), tiling
        for element in ELEMENTS:
            for mode in formats.SCALE_MODES:
                headroom = L.repack_headroom(formats.FORMATS[element])
                want = L.mx_repack_fp8(x, element, 32, mode)
                counted = int(T.mx_repack_fp8(x, element, 32, mode, headroom)[2])
                every = element == "fp6_e2m3" and mode == "rceil"
                for tiling in candidates if every else [candidates[0], candidates[-1]]:
                    got = T.mx_repack_fp8(x, element, 32, mode, headroom, tiling=tiling)
                    assert torch.equal(got[0].float(), want[0].float()), (element, mode, tiling)
                    assert torch.equal(got[1], want[1]) and int(got[2]) == counted, (element, mode, tiling)


@pytest.mark.gpu
def test_joined_quantizer_equals_the_torch_quantizer_on_the_gpu():
    """FP8 casts included, and through the custom op a compiled block calls (schema and fake: opcheck)."""
    check_joined_quantizer("cuda", None)  # FP8 codes
    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    prefix = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(L.rowwise_fp8_joined_op, (x, prefix, "gelu_tanh", L.fp8_dtype()))


@pytest.mark.gpu
def test_triton_repack_counts_the_inexact_rows_as_the_reference():
    """Whole activations and each row alone (a zero row, a row with a far block: rows a per-program count or a
    comparison of E4M3 values cast back would count wrongly)."""
    for x in (activation("cuda"), long_activation("cuda")):
        for element in ELEMENTS:
            for mode in formats.SCALE_MODES:
                for part in [x] + list(x.split(1)):
                    got = L.mx_repack_fp8_op(part.contiguous(), element, 32, mode)
                    want = L.mx_repack_fp8(part, element, 32, mode)
                    assert int(got[2]) == int(want[2]), (element, mode, part.shape)
    check_counted_repack("cuda")


@pytest.mark.gpu
def test_mx_repack_linear_counts_inexact_activation_rows_on_the_gpu():
    """The linear's eager GPU path (the counted kernel) equals the emulation and counts as the CPU path does
    (tests/test_precision.py): a row with a block far above the rest is inexact, call after call."""
    g = torch.Generator().manual_seed(12)
    w, x = torch.randn(48, 128, generator=g) / 8, torch.randn(70, 128, generator=g)
    fmt = L.LINEAR_FORMATS.get("mxfp6", "test")
    fast = L.QuantizedLinear.with_backend(w.cuda(), fmt, "mx_repack_fp8")
    want = L.QuantizedLinear.with_backend(w.cuda(), fmt, "emulation")(x.cuda())
    assert relative_error(fast(x.cuda()).float(), want.float()) < 1e-2  # the GEMM's output is bf16
    counts = fast.backends["mx_repack_fp8"].inexact_rows
    assert int(counts["activation"]) == 0
    x[3, :32] *= 2.0**24
    fast(x.cuda()), fast(x.cuda())
    assert int(counts["activation"]) == 2


@pytest.mark.gpu
def test_fused_qk_quantizer_equals_the_reference_on_the_gpu():
    check_qk_quantizer(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("v_format, tolerance", [("bf16", 1e-2), ("mxfp6", 1e-2), ("fp8", 1e-2)])
def test_triton_int8qk_equals_the_reference(v_format, tolerance):
    """The Triton kernel, V's values of every format in BF16 (P @ V a BF16 dot, as the reference)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1000, 4, 128, generator=g).cuda().to(torch.bfloat16) for _ in range(3))
    ops = quantize_operands(q, k, v, v_format)
    got = int8qk_attention_op(ops.q, ops.q_scale, ops.k, ops.k_scale, ops.v, 1 / math.sqrt(128), "triton")
    assert relative_error(got.float(), int8qk_emulation(ops, 1 / math.sqrt(128)).float()) < tolerance


@pytest.mark.gpu
@pytest.mark.parametrize(
    "s, config",
    [
        (1000, {}),
        (4608, {}),
        (200, {"block_n": 64}),
        (256, {}),
        (1000, {"v_fp8": True}),
        (4608, {"v_fp8": True}),
        (100, {"v_fp8": True}),
        (135, {"v_fp8": True}),
        (133, {}),
        (50, {"v_fp8": True}),
        (4097, {}),
        (1000, {"v_fp8": True, "block_n": 64}),
        (1000, {"stages": 3}),
        (1000, {"v_fp8": True, "stages": 3}),
    ],
)
def test_gluon_int8qk_equals_the_reference(s, config):
    """The Hopper Gluon kernel (kernels/attention_gluon.py) on quantized operands of two batches of three heads:
    sequences shorter than a tile, uneven and even, so that tiles cross from one head's rows into the next; S not a
    multiple of 4 puts a head's key scales off the 16-byte boundary a TMA tile starts on (``_key_scales``).
    ``v_fp8``: FP8-exact V and an FP8 P @ V, P rounded to E4M3 (2^8 P), which the reference does not round: a few
    % (max-norm); a wrong key order in V^T, or row sums added at the FP8 products' precision over many tiles, are
    off by far more."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon INT8-QK kernel is for Hopper (sm_90)")
    gluon = pytest.importorskip("ditrun.kernels.attention_gluon", reason="this Triton has no Gluon Hopper API")
    g = torch.Generator().manual_seed(s)
    q, k, v = (torch.randn(2, s, 3, 128, generator=g).cuda().to(torch.bfloat16) for _ in range(3))
    fp8 = config.get("v_fp8", False)
    ops = quantize_operands(q, k, v, "fp8" if fp8 else "bf16")
    got = gluon.int8qk_gluon(ops.q, ops.q_scale, ops.k, ops.k_scale, ops.v, 1 / math.sqrt(128), **config).float()
    error = relative_error(got, int8qk_emulation(ops, 1 / math.sqrt(128)).float())
    print(f"S = {s} {config}: error {error:.2e}")
    assert error < (5e-2 if fp8 else 1e-2)


@pytest.mark.gpu
def test_gluon_v_codes_equal_their_torch_statement():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon INT8-QK kernel is for Hopper (sm_90)")
    check_v_codes("cuda")


@pytest.mark.gpu
def test_v_codes_of_a_view_whose_head_offsets_pass_2_31():
    """V [B, S, H, D] as a view of [B, H, S, D] memory: the last head starts past 2^31 elements from the first
    (750k tokens, 24 heads of 128, 4.6 GB). The kernels' head offset in 32 bits would wrap there and read another
    head; the first and last heads' codes and scales equal the torch statement's on those heads alone."""
    from ditrun.kernels.attention import fp8_v_codes
    from ditrun.kernels.attention_triton import fp8_v_codes as triton_fp8_v_codes

    heads, tokens, dim = 24, 750_000, 128
    assert (heads - 1) * tokens * dim > 2**31
    if torch.cuda.mem_get_info()[0] < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(7)
    v = torch.empty(1, heads, tokens, dim, device="cuda", dtype=torch.bfloat16)
    for h in range(heads):  # a different scale per head: a head read in another's place shows
        v[:, h].normal_(0, 2.0 ** (h % 5 - 2), generator=g)
    codes, scale = triton_fp8_v_codes(v.transpose(1, 2))
    padded = codes.shape[1]
    for h in (0, heads - 1):
        want_codes, want_scale = fp8_v_codes(v[:, h : h + 1])
        got = codes.view(heads, dim, padded)[h]
        assert torch.equal(got.view(torch.uint8), want_codes.view(torch.uint8)), h
        assert torch.equal(scale[h : h + 1], want_scale), h


@pytest.mark.timeout(240)
def test_the_hopper_kernel_compiles_here_for_sm90_or_the_op_falls_back():
    """The Gluon INT8-QK kernel built for sm_90 by this machine's Triton and its ptxas (no GPU needed), with BF16
    and with FP8 V: INT8, BF16 and FP8 ``wgmma`` in the PTX and a cubin; or, where this Triton's Gluon API has
    moved, an error of the kinds the op catches to run the Triton kernel instead (an xfail that names it), never
    one that would end a run."""
    pytest.importorskip("triton")
    import triton

    from ditrun.kernels.attention import _gluon_kernels, gluon_compile_errors

    gluon = _gluon_kernels()
    if gluon is None:
        pytest.skip(f"Triton {triton.__version__} has no Gluon Hopper API: the op runs the Triton kernel")
    try:
        kernel, fp8_kernel = compile_sm90(gluon), compile_sm90(gluon, v_fp8=True)
    except ImportError as failure:  # compile_sm90's entry points into Triton, not the kernel's API
        pytest.skip(f"Triton {triton.__version__} cannot build Gluon kernels without a GPU here: {failure}")
    except gluon_compile_errors() as failure:
        pytest.xfail(
            f"Triton {triton.__version__} does not compile the Gluon kernel ({type(failure).__name__}); "
            "the op falls back to the Triton kernel"
        )
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in ptx  # Q.K^T
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx  # P @ V
    assert "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16" in ptx  # the row sums, P @ ones
    ptx = fp8_kernel.asm["ptx"]  # FP8 P @ V
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx and "m64n8k32.f32.e4m3.e4m3" in ptx
    assert kernel.asm["cubin"] and fp8_kernel.asm["cubin"]


def compile_sm90(gluon, d: int = 128, block_n: int = 128, stages: int = 4, even: bool = True, v_fp8: bool = False):
    """The Gluon kernel compiled for sm_90 without a GPU (Triton's own ptxas): the ``CompiledKernel`` (its ``asm``
    holds the PTX and the cubin) for BF16 V, or FP8 V."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    blocks = gluon._blocks(d, block_n, gl.float8e4nv if v_fp8 else gl.bfloat16)
    v_element = "fp8e4nv" if v_fp8 else "bf16"
    element = {"q": "i8", "k": "i8", "ks": "fp32", "v": v_element, "ones": v_element}
    signature = {
        f"{name}_desc": f"tensordesc<{element[name]}{shape},{layout!r}>" for name, (shape, layout) in blocks.items()
    }
    signature |= {
        "QS": "*fp32",
        "VS": "*fp32",
        "O": "*bf16",
        "S": "i32",
        "S_KS": "i32",
        "sm_scale_log2": "fp32",
        "D": "constexpr",
        "BLOCK_N": "constexpr",
        "STAGES": "constexpr",
        "EVEN": "constexpr",
        "V_FP8": "constexpr",
    }
    constants = {"D": d, "BLOCK_N": block_n, "STAGES": stages, "EVEN": even, "V_FP8": v_fp8}
    source = GluonASTSource(gluon._int8qk_kernel, signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def test_the_kernels_int32_to_fp32_conversion_is_exact():
    """The INT8 kernels' conversion of their Q.K sums (``attention_triton.INT_MAGIC``, ``ROUND_MAGIC``): x plus the
    bits of 1.5 * 2^23 read as fp32, minus 1.5 * 2^23, is float(x) exactly for |x| < 2^22, which bounds every sum
    of 128 (and 256) products of codes within +-127."""
    pytest.importorskip("triton")
    from ditrun.kernels.attention_triton import INT_MAGIC, ROUND_MAGIC

    assert (INT_MAGIC.value, ROUND_MAGIC.value) == (0x4B400000, 1.5 * 2**23)
    bound = 127 * 127 * 256
    assert bound < 2**22
    g = torch.Generator().manual_seed(0)
    edges = [-bound, -1, 0, 1, bound, 127 * 127 * 128, -(2**22) + 1, 2**22 - 1]
    x = torch.cat(
        [
            torch.randint(-bound, bound + 1, (100_000,), generator=g, dtype=torch.int32),
            torch.tensor(edges, dtype=torch.int32),
        ]
    )
    converted = (x + INT_MAGIC.value).view(torch.float32) - ROUND_MAGIC.value
    assert torch.equal(converted, x.float())


def test_fp8_v_codes_decode_to_quantize_v():
    """``attention.fp8_v_codes`` (what the compiled quantization writes for the Hopper FP8 P @ V), decoded by
    ``fp8_v_values``, is ``quantize_v(v, "fp8")`` exactly, for S even, uneven and below 32 (its key order is
    checked against the Triton kernel's in ``check_v_codes`` and, on the GPU, by the product itself)."""
    from ditrun.kernels.attention import fp8_v_codes, fp8_v_values, quantize_v

    g = torch.Generator().manual_seed(2)
    for s in (96, 100, 17):
        v = (3 * torch.randn(2, 3, s, 128, generator=g)).to(torch.bfloat16)
        codes, scale = fp8_v_codes(v)
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == (2 * 3 * 128, -(-s // 32) * 32)
        assert torch.equal(fp8_v_values(codes, scale, v.shape), quantize_v(v, "fp8"))


@pytest.mark.gpu
def test_int8qk_fp8v_with_the_fp8_product_equals_the_reference():
    """``int8qk_fp8v`` as a model built on Hopper runs it: V's codes written by the compiled quantization, the
    Gluon kernel's FP8 P @ V; against the torch reference of the same quantization (P unrounded there: a few %)."""
    from ditrun.kernels import attention as A

    device = torch.device("cuda", torch.cuda.current_device())
    kernel = A.ATTENTION_KERNELS.get("int8qk_fp8v")
    if A.choose_implementation(kernel, device, 128, fast=True) != "gluon":
        pytest.skip("the Gluon INT8-QK kernel runs on Hopper (sm_90) with a Triton that compiles it")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1000, 4, 128, generator=g).cuda().to(torch.bfloat16) for _ in range(3))
    fast, reference = (kernel.make(implementation) for implementation in ("gluon", "emulation"))
    got = fast(q, k, v)
    assert got.dtype == torch.bfloat16 and relative_error(got.float(), reference(q, k, v).float()) < 5e-2
