"""The compile tier: every Triton and Gluon kernel ditrun ships, built on this CPU machine for each GPU target the
dispatch sends it to (gfx950 = MI355X, gfx942 = MI300X, sm_90a = Hopper) at the published workload's shapes
(``kernels/builds.py``), and its machine code checked for what makes it fast there. No GPU runs anything here;
nothing has run on AMD hardware (docs/PRECISION.md#built-for-every-target).

Every build of ``builds.builds()`` is compiled, into a Triton cache that is empty at the start (a fresh machine's
state): about 40 s on one core, with Triton 3.9 (3.6 falls short on three builds: docs/PRECISION.md). The quantizers are built at the Flux linears' K (the tilings ``default_tiling`` picks there: one tile
and looped), the attention kernel at the H200's tile in its masked and unmasked variants, the MX GEMM for each
element format; configurations that share their code path with these are not built again."""

import importlib
import inspect
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
    if build.name == "mx_gemm_triton._mx_gemm_kernel" and target == "gfx950":
        # the K loop's scaled MFMAs (32 x 32 x 64 each, on every wave) do the tile's products once: no more, no less
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


@pytest.mark.slow
def test_mx_gemm_equals_the_exact_codecs_in_the_cpu_interpreter():
    """``kernels/mx_gemm_triton.py`` in Triton's CPU interpreter (a fresh process: TRITON_INTERPRET is read when
    kernels are defined), whose ``tl.dot_scaled`` takes E4M3 and E2M1 as the kernel hands them (MXFP6 through its
    E4M3 re-encoding)."""
    code = "import test_kernel_builds as t; t.check_mx_gemm_every_code(); t.check_mx_gemm_random(); t.check_mx_triton_linear()"
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


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
