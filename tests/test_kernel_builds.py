"""The compile tier: every Triton and Gluon kernel ditrun ships, built on this CPU machine for each GPU target the
dispatch sends it to (gfx950 = MI355X, gfx942 = MI300X, sm_90a = Hopper) at the published workload's shapes
(``kernels/builds.py``), and its machine code checked for what makes it fast there. No GPU runs anything here;
nothing has run on AMD hardware (docs/PRECISION.md#built-for-every-target).

Every build of ``builds.builds()`` is compiled, into a Triton cache that is empty at the start (a fresh machine's
state): about 50 s on one core, with Triton 3.9 (3.6 falls short on three builds: docs/PRECISION.md). The quantizers are built at the Flux linears' K (the tilings ``default_tiling`` picks there: one tile
and looped), the attention kernel at the H200's tile in its masked and unmasked variants, the MX GEMM for each
element format on gfx950 (once on sm_90a), the MX activation quantizer and the fused up projection for each code
width (8, 6, 4 bits) and activation; configurations that share their code path with these are not built again."""

import importlib
import inspect
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from ditrun.kernels import builds as B  # noqa: E402

BUILDS = B.builds()
CASES = [(build, target) for build in BUILDS for target in build.targets]


@pytest.fixture(scope="module", autouse=True)
def fresh_triton_cache(tmp_path_factory):
    """Triton's cache in a folder of this run: nothing built before is reused, nothing built here is kept."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 runs kernels on the CPU; it builds nothing")
    previous = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    yield
    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous


@pytest.mark.parametrize(
    "build, target", CASES, ids=[f"{b.name.split('.')[1]}[{b.config}]-{t}".replace(" ", "") for b, t in CASES]
)
def test_kernel_builds_for_the_target_and_its_machine_code_holds_what_the_design_needs(build, target):
    built = B.compile_build(build, target)
    assert not B.problems(built), (B.problems(built), built.matrix)
    if build.name.startswith("mx_gemm_triton._mx_gemm") and target == "gfx950":  # the GEMM and the fused one
        # the K loop's scaled MFMAs (32 x 32 x 64 each, on every wave) do the tile's products once: no more, no less
        # (SwiGLU's two products are two loops)
        tile = build.constexprs["BLOCK_M"] * build.constexprs["BLOCK_N"] * build.constexprs["BLOCK_K"]
        (instruction, count), *others = built.loop_matrix.items()
        assert not others and re.fullmatch(B.MFMA_SCALED, instruction) and "32x32x64" in instruction
        assert count * build.options["num_warps"] * 32 * 32 * 64 == tile


def _launched_kernels() -> dict[str, set[str]]:
    """``module.kernel`` of every jitted function in ditrun/kernels that no other jitted function names (calls, or
    hands to ``warp_specialize``): what the host code launches. module -> kernel names."""
    from triton.runtime.jit import JITFunction

    kernels_dir = Path(B.__file__).parent
    found = {}
    for path in sorted(kernels_dir.glob("*.py")):
        source = path.read_text()
        if "@triton.jit" not in source and "@gluon.jit" not in source:
            continue
        try:
            module = importlib.import_module(f"ditrun.kernels.{path.stem}")
        except (ImportError, AttributeError):  # the Gluon kernel on a Triton without its Hopper API: not shipped there
            continue
        jitted = {
            name: f
            for name, f in vars(module).items()
            if isinstance(f, JITFunction) and f.__module__ == module.__name__
        }
        bodies = {name: inspect.getsource(f.fn) for name, f in jitted.items()}
        called = {
            name
            for name in jitted
            for other, body in bodies.items()
            if other != name and re.search(rf"\b{name}\b", body)
        }
        found[path.stem] = set(jitted) - called
    return found


def test_every_shipped_kernel_is_built_for_every_target_or_says_why_not():
    """A kernel added to ditrun/kernels is in ``builds.builds()``; one a target never gets is in ``NOT_BUILT`` with
    the reason (the Gluon kernel is Hopper's: built for sm_90a, listed for AMD)."""
    built = {}
    for build in BUILDS:
        built.setdefault(build.name, set()).update(build.targets)
    for module, kernels in _launched_kernels().items():
        for kernel in kernels:
            name = f"{module}.{kernel}"
            assert name in built, f"{name} is not in kernels/builds.py"
            if set(B.TARGETS) - built[name]:
                assert name in B.NOT_BUILT, f"{name} is not built for {set(B.TARGETS) - built[name]} and says not why"
    assert set(B.NOT_BUILT) <= set(built)


def test_the_hopper_gluon_kernel_does_not_build_for_amd():
    """The reason ``NOT_BUILT`` gives for the Gluon kernel holds: Triton refuses its Hopper layouts for gfx950."""
    gluon = [b for b in BUILDS if b.gluon]
    if not gluon:
        pytest.skip(f"Triton {triton.__version__} has no Gluon Hopper API: the kernel is not shipped here")
    with pytest.raises(Exception):  # noqa: B017 - whichever stage of Triton's pipeline refuses it
        B.compile_build(gluon[0], "gfx950")


MX_ELEMENTS = ["fp8_e4m3", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"]


def check_mx_gemm_every_code() -> None:
    """The kernel reads every code of each element format as its value (``formats.decode``), in K order: A holds
    each code once, B is the identity under scale 2^0, so A B^T is A's values, exact."""
    import torch

    from ditrun.kernels import formats
    from ditrun.kernels.mx_gemm_triton import mx_gemm

    for element in MX_ELEMENTS:
        fmt = formats.FORMATS[element]
        k = max(2**fmt.bits, 32) if fmt.bits < 8 else 256  # whole blocks of 32
        codes = torch.arange(k, dtype=torch.int64).remainder(2**fmt.bits)
        codes = torch.where(torch.isnan(formats.decode(codes.to(torch.uint8), fmt)), 0, codes).to(torch.uint8)
        one = formats.encode(torch.ones(()), fmt)
        identity = torch.where(torch.eye(k, dtype=torch.bool), one, torch.zeros((), dtype=torch.uint8))
        unit = torch.full((1, k // 32), formats.E8M0_BIAS, dtype=torch.uint8)
        got = mx_gemm(formats.pack(codes[None], fmt), unit, formats.pack(identity, fmt), unit.expand(k, -1), element,
                      torch.float32, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64})  # fmt: skip
        assert torch.equal(got[0], formats.decode(codes, fmt)), element


def check_mx_gemm_random() -> None:
    """On fresh random operands (a seed per run: printed), ragged in M, N and the last K tile, six decades across K:
    the kernel equals the exact codecs' product (``formats.dequantize_mx`` of each operand, an fp64 matmul) within
    fp32 accumulation: |error| <= K * 2^-23 * sum |a b| (each of <= K additions rounds once, 2^-24, doubled for the
    products' partial sums)."""
    import torch

    from ditrun.kernels import formats
    from ditrun.kernels.mx_gemm_triton import mx_gemm

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    for element in MX_ELEMENTS:
        for m, n, k, tiles in [(40, 24, 96, {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64}), (70, 130, 256, None)]:
            x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)
            w = torch.randn(n, k, generator=g)
            a, b = formats.quantize_mx(x, element), formats.quantize_mx(w, element)
            da, db = formats.dequantize_mx(*a, element).double(), formats.dequantize_mx(*b, element).double()
            got = mx_gemm(*a, *b, element, torch.float32, tiles).double()
            bound = k * 2.0**-23 * (da.abs() @ db.abs().T)
            assert ((got - da @ db.T).abs() <= bound).all(), (element, m, n, k, seed)


def check_mx_triton_linear() -> None:
    """The ``mx_triton`` backend as the model runs it (``QuantizedLinear``: the activation quantized by the exact codec,
    the GEMM this kernel) equals the ``emulation`` backend (the reference) for every MX format it runs, within fp32
    accumulation (the emulation's matmul is fp32 on the CPU)."""
    import torch

    from ditrun.kernels import linear as L

    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(48, 160, generator=g) / 8, torch.randn(37, 160, generator=g)
    for name in ("mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4"):
        fmt = L.LINEAR_FORMATS.get(name, "test")
        got = L.QuantizedLinear.with_backend(w, fmt, "mx_triton")(x)
        want = L.QuantizedLinear.with_backend(w, fmt, "emulation")(x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


def in_the_interpreter(code: str) -> None:
    """Run ``code`` (beside this file) in a fresh process under TRITON_INTERPRET=1, which Triton reads when kernels
    are defined; it must exit 0."""
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


@pytest.mark.slow
def test_mx_gemm_equals_the_exact_codecs_in_the_cpu_interpreter():
    """``kernels/mx_gemm_triton.py`` in Triton's CPU interpreter (a fresh process: TRITON_INTERPRET is read when
    kernels are defined), whose ``tl.dot_scaled`` takes E4M3 and E2M1 as the kernel hands them (MXFP6 through its
    E4M3 re-encoding)."""
    code = "import test_kernel_builds as t; t.check_mx_gemm_every_code(); t.check_mx_gemm_random(); t.check_mx_triton_linear()"
    in_the_interpreter(code)


@pytest.mark.slow
def test_the_fused_mx_kernels_equal_the_exact_codecs_in_the_cpu_interpreter():
    """The activation quantizer, the MLP's fused up projection (GELU and SwiGLU epilogues writing the down
    projection's MX operand), the model's MLPs and stacked projections through them, and the custom ops that wrap
    them, in Triton's CPU interpreter (a fresh process)."""
    code = (
        "import test_kernel_builds as t; t.check_mx_quantize_equals_the_codec(); t.check_mx_gemm_act_random(); "
        "t.check_quantized_mlp_in_the_model(); t.check_stacked_projection(); "
        "t.check_custom_ops_agree_with_their_fakes()"
    )
    in_the_interpreter(code)


def test_the_backend_runs_the_element_formats_the_kernel_reads():
    """``linear.MxTriton`` offers the MX formats of the kernel's element formats, and elsewhere than gfx950 says it
    needs gfx950 (here: a CPU)."""
    from ditrun.kernels import linear as L
    from ditrun.kernels import mx_gemm_triton

    assert L.MxTriton.ELEMENTS == tuple(mx_gemm_triton.ELEMENTS)
    backend, cpu = L.MxTriton(), torch.device("cpu")
    why = {name: backend.unavailable(fmt, cpu) for name, fmt in L.LINEAR_FORMATS.items()}
    assert [name for name, reason in why.items() if "gfx950" in reason] == ["mxfp8", "mxfp6", "mxfp6_e3m2", "mxfp4"]


@pytest.mark.gpu
def test_the_fused_mx_kernels_equal_the_exact_codecs_on_the_gpu():
    """The interpreter's checks of the activation quantizer and the fused up projection on a GPU (the H100: Triton's
    emulation of the scaled dot), at the tiles the model runs."""
    check_mx_quantize_equals_the_codec("cuda")
    check_mx_gemm_act_random("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("element", MX_ELEMENTS)
def test_mx_gemm_equals_the_exact_codecs_on_the_gpu(element):
    """The same source on a GPU: on gfx950 the scaled MFMA; elsewhere (the H100) Triton's emulation of the scaled dot.
    Flux's hidden size, ragged M and N; bound as in ``check_mx_gemm_random`` (the output is fp32)."""
    from ditrun.kernels import formats
    from ditrun.kernels.mx_gemm_triton import mx_gemm

    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(300, 3072, generator=g), torch.randn(520, 3072, generator=g) / 8
    a, b = formats.quantize_mx(x, element), formats.quantize_mx(w, element)
    da, db = formats.dequantize_mx(*a, element).double(), formats.dequantize_mx(*b, element).double()
    got = mx_gemm(*(t.cuda() for t in (*a, *b)), element, torch.float32).double().cpu()
    assert ((got - da @ db.T).abs() <= 3072 * 2.0**-23 * (da.abs() @ db.abs().T)).all()


def _grid_neighbours(y: torch.Tensor, element: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid values of ``element`` at and around y (fp64; |y| within the format's range): (below, above)."""
    from ditrun.kernels import formats

    grid = torch.tensor(formats.FORMATS[element].finite, dtype=torch.float64)
    hi = torch.bucketize(y.abs(), grid).clamp(1, len(grid) - 1)
    return torch.copysign(grid[hi - 1], y), torch.copysign(grid[hi], y)


def assert_codes_of(codes, scales, want: torch.Tensor, error: torch.Tensor, element: str) -> float:
    """Packed MX ``codes`` and ``scales`` (a kernel's) equal ``formats.quantize_mx`` of the fp64 values ``want``,
    except where a value lies within its bound ``error`` of a rounding boundary: a block whose amax is within it of
    a change of scale (the block not compared), or an element within it of a midpoint between two grid values
    (then either neighbour). Returns the share of elements compared exactly (so that a test sees it is most)."""
    from ditrun.kernels import formats

    fmt = formats.FORMATS[element]
    blocks, err = want.unflatten(-1, (-1, 32)), error.unflatten(-1, (-1, 32))
    amax, slack = blocks.abs().amax(-1), err.amax(-1)
    low = formats.shared_exponents((amax - slack).clamp(min=0).float(), fmt)
    high = formats.shared_exponents((amax + slack).float(), fmt)
    settled = (low == high) & (formats.shared_exponents(amax.float(), fmt) == low)  # the scale cannot move
    got_scales = scales.long() - formats.E8M0_BIAS
    assert torch.equal(got_scales[settled], low[settled])
    scale = torch.ldexp(torch.ones_like(blocks), got_scales[..., None].double())
    got = formats.decode(formats.unpack(codes, element), element).double().unflatten(-1, (-1, 32))
    y, t = blocks / scale, err / scale
    below, above = _grid_neighbours(y, element)
    tie = (y.abs() - (below.abs() + above.abs()) / 2).abs() <= t  # the midpoint within reach of the bound
    exact = formats.decode(formats.encode(y.float(), element), element).double()
    strict = settled[..., None] & ~tie
    assert torch.equal(got[strict], exact[strict]), (got[strict] != exact[strict]).sum()
    loose = settled[..., None] & tie
    assert ((got[loose] == below[loose]) | (got[loose] == above[loose])).all()
    return strict.double().mean().item()


def _gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form from its definition (fp64)."""
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))


def _silu(h: torch.Tensor) -> torch.Tensor:
    return h * torch.sigmoid(h)


def _reach(f, h: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """max |f(x) - f(h)| over |x - h| <= error: f at 33 points across the interval, plus what a curvature of at most
    0.8 (GELU's and silu's bound) can add between them."""
    points = h[..., None] + error[..., None] * torch.linspace(-1, 1, 33, dtype=torch.float64)
    return (f(points) - f(h)[..., None]).abs().amax(-1) + 0.8 * (error / 16) ** 2


def check_mx_quantize_equals_the_codec(device: str = "cpu") -> None:
    """The activation quantizer equals ``formats.quantize_mx`` bit for bit, for both scale rules, on fresh random
    fp32 and BF16 rows spanning 40 decades, ragged in M, with zero blocks, signed zeros and (fp32, in the
    interpreter; a GPU may flush them) a subnormal block."""
    from ditrun.kernels import formats
    from ditrun.kernels.mx_gemm_triton import mx_quantize

    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    for element in MX_ELEMENTS:
        for mode in formats.SCALE_MODES:
            x = torch.randn(37, 320, generator=g) * torch.logspace(-20, 20, 320)
            x[0, :32], x[1, 5] = 0.0, -0.0
            bf16 = x.bfloat16()  # no subnormals: Triton 3.9's interpreter converts BF16 subnormals to fp32 wrongly
            if device == "cpu":
                x[2, 32:64] = torch.randn(32, generator=g) * 1e-40
            for rows in (x, bf16):
                got, want = mx_quantize(rows.to(device), element, mode), formats.quantize_mx(rows, element, 32, mode)
                assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (element, mode, seed)


def check_mx_gemm_act_random(device: str = "cpu") -> None:
    """The fused up projection on fresh random operands (a seed per run: printed), ragged in M, N not a multiple of
    the tile, for GELU(tanh) and SwiGLU: its codes and scales are ``formats.quantize_mx`` of the activation of the
    exact codecs' product plus the bias (fp64), up to ties within the bound of the kernel's error:
    |h error| <= e_h = K 2^-23 sum |a b| + 2^-23 |h| (fp32 accumulation, then the bias); the activation's error
    <= how far f moves within e_h of h (``_reach``; SwiGLU: silu's reach times |b| + e_b, plus |silu(a)| e_b)
    + 2^-20 (1 + |z| (1 - sigmoid(z))) |value| (its fp32 evaluation: a few roundings and a sigmoid, the
    sigmoid's argument z amplified by its relative slope) + 2^-24 |value| (the reference's rounding to fp32)
    + 2^-140 (fp32 subnormals)."""
    from ditrun.kernels import formats
    from ditrun.kernels.mx_gemm_triton import mx_gemm_act

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    for element in MX_ELEMENTS:
        for activation in ("gelu_tanh", "swiglu"):
            m, n, k = 45, 96, 160
            x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-8, 8, (m, 1), generator=g)
            w = torch.randn(2 * n if activation == "swiglu" else n, k, generator=g) / 8
            bias = torch.randn(w.shape[0], generator=g)
            a, b = formats.quantize_mx(x, element), formats.quantize_mx(w, element)
            da, db = formats.dequantize_mx(*a, element).double(), formats.dequantize_mx(*b, element).double()
            h = da @ db.T + bias.double()
            h_err = k * 2.0**-23 * (da.abs() @ db.abs().T) + 2.0**-23 * h.abs()
            if activation == "gelu_tanh":
                want, err = _gelu_tanh(h), _reach(_gelu_tanh, h, h_err)
                z = 2 * math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)
            else:
                (ha, hb), (ea, eb) = h.split(n, dim=1), h_err.split(n, dim=1)
                want, z = _silu(ha) * hb, ha
                err = _reach(_silu, ha, ea) * (hb.abs() + eb) + _silu(ha).abs() * eb
            err = err + (2.0**-20 * (1 + z.abs() * (1 - torch.sigmoid(z))) + 2.0**-24) * want.abs() + 2.0**-140
            tiles = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64} if device == "cpu" else None  # GPU: the model's
            operands = (t.to(device) for t in (*a, *b, bias))
            codes, scales = (t.cpu() for t in mx_gemm_act(*operands, element, activation, tiles=tiles))
            compared = assert_codes_of(codes, scales, want, err, element)
            assert compared > 0.9, (element, activation, compared, seed)


def check_quantized_mlp_in_the_model() -> None:
    """The model's MLPs with MX linears on ``mx_triton`` run the fused kernels (``linear.quantized_mlp``): Flux's
    double-stream ``FeedForward`` (GELU) and Krea 3's single-stream output projection (SwiGLU), whose operand joins
    the attention output (quantized by the activation quantizer) and the fused up projection's codes. Each equals
    the exact codecs' product of that operand (``formats.dequantize_mx``, fp64) with the down weight, plus its bias,
    within fp32 accumulation: K 2^-23 sum |a b| + 2^-23 |out| (the bias added in fp32)."""
    from ditrun.kernels import formats
    from ditrun.kernels import linear as L
    from ditrun.kernels.mx_gemm_triton import mx_gemm_act
    from ditrun.model import dit, presets

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    fmt = L.LINEAR_FORMATS.get("mxfp6", "test")

    def mx(linear: torch.nn.Linear) -> L.QuantizedLinear:
        q = L.QuantizedLinear.with_backend(linear.weight.detach(), fmt, "mx_triton")
        q.bias = torch.nn.Parameter(torch.randn(linear.out_features, generator=g), requires_grad=False)
        return q

    for variant in ("flux", "krea3"):
        geo = dit.DiTGeometry(**{**vars(presets.PRESETS["tiny"]), **presets.VARIANTS[variant]})
        x, attn = torch.randn(2, 9, geo.inner_dim, generator=g), torch.randn(2, 9, geo.inner_dim, generator=g)
        if variant == "flux":
            ff = dit.FeedForward(geo)
            up, down, prefix, epilogue = mx(ff.net[0].proj), mx(ff.net[2]), None, ff.epilogue
            ff.net[0].proj, ff.net[2] = up, down
            got = ff(x)
        else:
            single = dit.SingleStreamBlock(geo)
            up, down, prefix, epilogue = mx(single.proj_mlp), mx(single.proj_out), attn, "swiglu"
            single.proj_mlp, single.proj_out = up, down
            residual, gate = torch.zeros_like(x), torch.ones(2, geo.inner_dim)  # out = 0 + 1 * the projection
            got = single.post_attention(attn.unflatten(-1, (geo.num_attention_heads, -1)), residual, (gate, None, x))
        assert L.quantized_mlp(up, down, x[:, :0], epilogue, None if prefix is None else prefix[:, :0]) is not None
        w = up.weights["mx_triton"]
        codes, scales = mx_gemm_act(*formats.quantize_mx(x.flatten(0, 1), "fp6_e2m3"), w["codes"], w["scales"],
                                    up.bias, "fp6_e2m3", epilogue)  # fmt: skip
        operand = formats.dequantize_mx(codes, scales, "fp6_e2m3").double()
        if prefix is not None:
            operand = torch.cat([formats.fake_quantize(prefix.flatten(0, 1), "fp6_e2m3").double(), operand], 1)
        w = down.weights["mx_triton"]
        dw = formats.dequantize_mx(w["codes"], w["scales"], "fp6_e2m3").double()
        want = operand @ dw.T + down.bias.double()
        bound = operand.shape[1] * 2.0**-23 * (operand.abs() @ dw.abs().T) + 2.0**-23 * want.abs()
        assert ((got.flatten(0, 1).double() - want).abs() <= bound).all(), variant


def check_stacked_projection() -> None:
    """A Krea 3 double-stream block's stacked projections (Q, K, V and the attention gate of each stream: one
    ``QuantizedLinear``, ``model/quantize.py``) on ``mx_triton``: the input quantized once by the activation
    quantizer, one GEMM; Q, K and V as projected equal the exact codecs' product plus the bias within fp32
    accumulation (K 2^-23 sum |a b| + 2^-23 |out|), the gate its sigmoid within a quarter of that (the sigmoid's
    slope) + 2^-22."""
    from ditrun.kernels import formats
    from ditrun.kernels import linear as L
    from ditrun.model import dit, presets
    from ditrun.model.quantize import quantize_model

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    geo = dit.DiTGeometry(**{**vars(presets.PRESETS["tiny"]), **presets.VARIANTS["krea3"]})
    attn = dit.Attention(geo, dual=True, has_out=True)
    for linear in (*attn.linears(False), *attn.linears(True)):
        torch.nn.init.normal_(linear.bias, generator=g)
    weights = {text: [(lin.weight.detach().clone(), lin.bias.detach().clone()) for lin in attn.linears(text)]
               for text in (False, True)}  # fmt: skip
    fmt = L.LINEAR_FORMATS.get("mxfp6", "test")
    formats_of = {"qkv": fmt, "out": L.LINEAR_FORMATS.get("bf16", "test"), "mlp": L.LINEAR_FORMATS.get("bf16", "test")}
    replaced = quantize_model(torch.nn.ModuleDict({"block": torch.nn.ModuleDict({"attn": attn})}), formats_of,
                              "rceil", lambda f, k, n: ({"mx_triton": L.MxTriton()}, lambda m: "mx_triton"))  # fmt: skip
    assert replaced["qkv"] == 2  # one stack per stream
    for text in (False, True):
        x = torch.randn(2, 9, geo.inner_dim, generator=g)
        q, k, v, gate = attn.project(x, text=text, raw=True)
        xq = formats.fake_quantize(x.flatten(0, 1), "fp6_e2m3").double()
        for got, (w, b) in zip((q.flatten(2), k.flatten(2), v.flatten(2), gate), weights[text]):
            dw = formats.fake_quantize(w, "fp6_e2m3").double()
            want = xq @ dw.T + b.double()
            bound = xq.shape[1] * 2.0**-23 * (xq.abs() @ dw.abs().T) + 2.0**-23 * want.abs()
            if got is gate:
                want, bound = torch.sigmoid(want), bound / 4 + 2.0**-22
            assert ((got.flatten(0, 1).double() - want).abs() <= bound).all(), text


def check_custom_ops_agree_with_their_fakes() -> None:
    """The MX custom ops (``linear.mx_quantize_op``, ``linear.mx_mlp_op``, what compiled regions call) pass
    ``torch.library.opcheck``: their fake implementations give the real outputs' shapes and dtypes, the schemas hold."""
    from ditrun.kernels import formats
    from ditrun.kernels import linear as L

    x = torch.randn(5, 64)
    torch.library.opcheck(L.mx_quantize_op, (x, "fp6_e2m3", "rceil"))
    up, down = (
        formats.quantize_mx(torch.randn(64, 64), "fp4_e2m1"),
        formats.quantize_mx(torch.randn(32, 96), "fp4_e2m1"),
    )
    mlp = (x, torch.randn(5, 32), *up, torch.randn(64), *down, "fp4_e2m1", "gelu_tanh", "rceil")
    torch.library.opcheck(L.mx_mlp_op, mlp)
