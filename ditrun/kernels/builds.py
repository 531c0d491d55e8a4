"""Every Triton and Gluon kernel ditrun ships, built ahead of time for each GPU target without the GPU, and what its
machine code holds.

Triton compiles a kernel for ``GPUTarget("hip", "gfx950", 64)`` (MI355X), gfx942 (MI300X) and sm_90a (Hopper) down to
AMDGCN or PTX and a code object on any machine, so CI builds each kernel for every target the dispatch sends it to,
at the published workload's shapes (Flux: hidden 3072, MLP 12288, head dim 128), and reads in the machine code what
makes it fast there: the matrix instructions (scaled MFMA for MX operands on gfx950, INT8 and BF16 MFMA for the
INT8-QK attention, ``wgmma`` on sm_90a), and on AMD the registers, scratch (spills) and LDS against the chip's
limits. None of these builds has run on AMD hardware (docs/PRECISION.md#built-for-every-target).

``builds()`` is the inventory; ``NOT_BUILT`` names each kernel a target never gets, and why;
``tests/test_kernel_builds.py`` builds and checks them, ``benchmarks/kernel_builds.py`` prints the table.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TARGETS = {"gfx950": ("hip", "gfx950", 64), "gfx942": ("hip", "gfx942", 64), "sm_90a": ("cuda", 90, 32)}
"""Target name -> ``GPUTarget`` arguments (backend, arch, warp size)."""

LDS_BYTES = {"gfx950": 160 * 1024, "gfx942": 64 * 1024}
"""LDS a workgroup can have: CDNA4's 160 KiB per CU, CDNA3's 64 KiB."""
VGPRS = 512
"""Vector registers a wave can hold on gfx90a and later (256 architectural + 256 accumulation, unified)."""

FLUX = {"hidden": 3072, "mlp": 12288, "head_dim": 128}
"""The published workload's model (FLUX.1-Kontext-dev): the shapes the kernels are built at."""


@dataclass(frozen=True)
class Build:
    """One kernel at one configuration: what ``triton.compile`` needs, where the dispatch sends it, and the matrix
    instructions its machine code must hold on each target (regular expressions; a target not named: none)."""

    name: str
    """``module.kernel`` under ``ditrun/kernels``."""
    config: str
    """The configuration in words (shape, tiles)."""
    signature: dict[str, str]
    """Argument -> Triton type; ``*fp8`` is the target's E4M3 (OCP on gfx950 and sm_90a, FNUZ on gfx942)."""
    constexprs: dict[str, Any]
    options: dict[str, int]
    targets: tuple[str, ...]
    instructions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    gluon: bool = False

    def kernel(self):
        module, name = self.name.rsplit(".", 1)
        return getattr(importlib.import_module(f"ditrun.kernels.{module}"), name)

    def source(self, target: str):
        fnuz = target == "gfx942"
        signature = {k: ("*fp8e4b8" if fnuz else "*fp8e4nv") if v == "*fp8" else v for k, v in self.signature.items()}
        constexprs = {k: (240.0 if fnuz else 448.0) if k == "FP8_MAX" else v for k, v in self.constexprs.items()}
        if self.gluon:
            from triton.experimental.gluon._runtime import GluonASTSource

            return GluonASTSource(self.kernel(), signature, constexprs=constexprs)
        from triton.compiler import ASTSource

        return ASTSource(self.kernel(), signature, constexprs=constexprs)


def _signature(*names: str, **types: str) -> dict[str, str]:
    """Arguments in order: each of ``names`` as ``i32`` (sizes, strides) unless ``types`` gives it; constexprs last."""
    return {name: types.get(name, "i32") for name in names}


def _constexprs(signature: dict[str, str], **values) -> dict[str, Any]:
    signature.update({name: "constexpr" for name in values})
    return values


MFMA_I8 = r"v_mfma_i32_\w+_i8"
MFMA_BF16 = r"v_mfma_f32_\w+_bf16"
MFMA_SCALED = r"v_mfma_scale_f32_\w+_f8f6f4"
WGMMA_S8 = r"wgmma\.mma_async\.sync\.aligned\.\w+\.s32\.s8\.s8"
WGMMA_BF16 = r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16"
EVERY_GPU = ("gfx950", "gfx942", "sm_90a")


def _quantizer_builds() -> list[Build]:
    import triton

    from ditrun.kernels import linear, quantize_triton

    builds = []
    # qkv/out/up, down, single blocks' proj_out (eager calls); then a compiled block's down projections under
    # precision.quantizer=kernel: GELU(hidden), and [attention output | GELU(hidden)]
    cases = [(k, None, 0) for k in (FLUX["hidden"], FLUX["mlp"], FLUX["hidden"] + FLUX["mlp"])]
    cases += [(FLUX["mlp"], "gelu_tanh", 0), (FLUX["mlp"], "gelu_tanh", FLUX["hidden"])]
    for k, activation, prefix in cases:
        joined = activation is not None or prefix > 0
        t = quantize_triton.joined_tiling(k) if joined else quantize_triton.default_tiling(k, "fp8")
        sig = _signature(
            "X", "Y", "SCALE", "PREFIX", "R", "K", "P", "stride_x", "stride_y", "stride_p", X="*bf16", Y="*fp8",
            SCALE="*fp32", PREFIX="*bf16",
        )  # fmt: skip
        const = _constexprs(
            sig,
            FP8_MAX=448.0,
            BLOCK_R=t.rows,
            BLOCK_K=t.tile,
            BLOCK_P=triton.next_power_of_2(prefix) if prefix else 1,
            ONE_TILE=t.one_tile,
            HAS_PREFIX=prefix > 0,
            ACTIVATION=quantize_triton.ACTIVATIONS[activation],
            ON_BITS=False,
        )
        what = f"K={k}" + (f", {activation}" if activation else "") + (f", prefix {prefix}" if prefix else "")
        builds.append(
            Build("quantize_triton._rowwise_fp8_kernel", f"{what}, {t}", sig, const, {"num_warps": t.warps}, EVERY_GPU)
        )
    element = linear.formats.FORMATS["fp6_e2m3"]
    for k in (FLUX["hidden"], FLUX["mlp"]):
        t = quantize_triton.default_tiling(k, "mx")
        sig = _signature(
            "X", "Y", "SCALE", "COUNT", "R", "K", "stride_x", "stride_y", X="*bf16", Y="*fp8e4nv", SCALE="*fp32",
            COUNT="*i64",
        )  # fmt: skip
        const = _constexprs(
            sig,
            EMAX=element.emax,
            TOP_MANTISSA=element.max_value / 2.0**element.emax,
            RCEIL=True,
            MBITS=element.mantissa_bits,
            MIN_EXP=1 - element.bias,
            ELEM_MAX=element.max_value,
            HEADROOM=linear.repack_headroom(element),
            BLOCK=32,
            BLOCK_R=t.rows,
            NB=max(1, t.tile // 32),
            ONE_TILE=t.one_tile,
        )
        builds.append(
            Build(
                "quantize_triton._mx_repack_kernel",
                f"MXFP6 K={k}, {t}",
                sig,
                const,
                {"num_warps": t.warps},
                ("sm_90a",),
            )
        )
    return builds


def _attention_builds() -> list[Build]:
    from ditrun.kernels import attention_triton

    d = FLUX["head_dim"]
    builds = []
    best = attention_triton.CONFIGS[0]  # the H200's fastest; the autotuner's first candidate
    for even in (True, False):
        sig = _signature(
            "Q", "QS", "K", "KS", "V", "O", "sm_scale_log2", "S", "H", "stride_b", "stride_h", "stride_s",
            Q="*i8", QS="*fp32", K="*i8", KS="*fp32", V="*bf16", O="*bf16", sm_scale_log2="fp32",
        )  # fmt: skip
        const = _constexprs(sig, D=d, **best.kwargs, EVEN_N=even)
        builds.append(
            Build(
                "attention_triton._attention_forward",
                f"D={d}, {best.kwargs['BLOCK_M']}x{best.kwargs['BLOCK_N']} tiles, S {'' if even else 'not '}a multiple",
                sig,
                const,
                {"num_warps": best.num_warps, "num_stages": best.num_stages},
                EVERY_GPU,
                {"amd": (MFMA_I8, MFMA_BF16), "sm_90a": (WGMMA_S8, WGMMA_BF16)},
            )
        )
    sig = _signature(
        "X", "MEAN", "Y", "SCALE", "S", "H", "stride_xb", "stride_xs", "stride_xh", "stride_mb", "stride_mh",
        X="*bf16", MEAN="*bf16", Y="*i8", SCALE="*fp32",
    )  # fmt: skip
    const = _constexprs(sig, SMOOTH=True, D=d, BLOCK_S=64)
    builds.append(
        Build("attention_triton._quantize_qk_kernel", f"D={d}, smoothed K", sig, const, {"num_warps": 4}, EVERY_GPU)
    )
    sig = _signature("X", "OUT", "L", "H", "stride_xb", "stride_xl", "stride_xh", X="*bf16", OUT="*fp64")
    const = _constexprs(sig, D=d, BLOCK_L=64)
    builds.append(Build("token_sum_triton._token_sum_kernel", f"D={d}", sig, const, {"num_warps": 4}, EVERY_GPU))
    sig = _signature("X", "AMAX", "S", "H", "stride_xb", "stride_xs", "stride_xh", X="*bf16", AMAX="*fp32")
    const = _constexprs(sig, D=d, BLOCK_S=128)
    builds.append(Build("attention_triton._head_amax_kernel", f"D={d}", sig, const, {"num_warps": 4}, ("sm_90a",)))
    sig = _signature(
        "V", "SCALE_INV", "OUT", "S", "S_PAD", "H", "stride_vb", "stride_vs", "stride_vh",
        V="*bf16", SCALE_INV="*fp32", OUT="*fp8e4nv",
    )  # fmt: skip
    const = _constexprs(sig, D=d, BLOCK=64)
    builds.append(Build("attention_triton._fp8_v_codes_kernel", f"D={d}", sig, const, {"num_warps": 4}, ("sm_90a",)))
    return builds


def _qk_producer_builds() -> list[Build]:
    d = FLUX["head_dim"]
    strides = ("stride_xb", "stride_xl", "stride_xh")
    tables = {"X": "*bf16", "W": "*bf16", "COS": "*fp32", "SIN": "*fp32", "eps": "fp32"}
    sig = _signature(
        "X", "W", "COS", "SIN", "KSUM", "AMAX", "L", "H", *strides, "eps", KSUM="*fp64", AMAX="*fp32", **tables
    )
    const = _constexprs(sig, D=d, BLOCK_L=16)  # qk_producer_triton.BLOCK_L, WARPS: what ships
    builds = [Build("qk_producer_triton._statistics_kernel", f"D={d}", sig, const, {"num_warps": 4}, EVERY_GPU)]
    out = ("stride_cb", "stride_cl", "stride_cp", "stride_ch", "stride_sb", "stride_sl", "stride_sp", "stride_sh")
    sig = _signature(
        "X", "W", "COS", "SIN", "MEAN", "CODES", "SCALE", "L", "H", "HP", *strides, *out, "eps",
        MEAN="*bf16", CODES="*i8", SCALE="*fp32", **tables,
    )  # fmt: skip
    const = _constexprs(sig, SMOOTH=True, D=d, BLOCK_L=16)
    builds.append(
        Build("qk_producer_triton._quantize_kernel", f"D={d}, smoothed K", sig, const, {"num_warps": 4}, EVERY_GPU)
    )
    return builds


def _mx_gemm_builds() -> list[Build]:
    from ditrun.kernels import mx_gemm_triton as G

    builds = []
    tiles = {k: v for k, v in G.DEFAULT_TILES.items() if k.startswith("BLOCK")}
    options = {k: v for k, v in G.DEFAULT_TILES.items() if k.startswith("num")}
    for element, code in G.ELEMENTS.items():
        sig = _signature(
            "A", "A_SCALE", "B", "B_SCALE", "C", "M", "N", "K", "stride_a", "stride_as", "stride_b", "stride_bs",
            "stride_c", A="*u8", A_SCALE="*u8", B="*u8", B_SCALE="*u8", C="*bf16",
        )  # fmt: skip
        const = _constexprs(sig, ELEMENT=code, **tiles)
        config = f"{element}, {tiles['BLOCK_M']}x{tiles['BLOCK_N']}x{tiles['BLOCK_K']} tiles"
        builds.append(
            Build(
                "mx_gemm_triton._mx_gemm_kernel",
                config,
                sig,
                const,
                options,
                # sm_90a: Triton's emulation of the scaled dot, which only the GPU suite runs (Hopper's MX linears
                # are mx_repack_fp8): built once, for the FP6 unpacking, the one read the other formats lack
                ("gfx950", "sm_90a") if element == "fp6_e2m3" else ("gfx950",),
                {"gfx950": (MFMA_SCALED,)},
            )
        )
    return builds


def _mx_fused_builds() -> list[Build]:
    """The MX activation quantizer and the MLP's fused up projection: their code depends on the element's bit width
    (packing) and, for the fused GEMM, the activation, not on the shapes (runtime sizes)."""
    from ditrun.kernels import mx_gemm_triton as G

    builds = []
    for element in ("fp8_e4m3", "fp6_e2m3", "fp4_e2m1"):
        sig = _signature("X", "CODES", "SCALES", "M", "K", "stride_x", "stride_c", "stride_s", X="*bf16", CODES="*u8",
                         SCALES="*u8")  # fmt: skip
        tiles = {k: v for k, v in G.QUANTIZE_TILES.items() if k.startswith("BLOCK")}
        const = _constexprs(sig, **G.element_constants(element), RCEIL=True, **tiles)
        # E2M3 on every GPU: it writes the quantized exchange's MXFP6 V (attention_payload.mx_rows)
        targets = EVERY_GPU if element == "fp6_e2m3" else ("gfx950",)
        builds.append(Build("mx_gemm_triton._mx_quantize_kernel", f"{element}, {tiles['BLOCK_M']}x{tiles['BLOCK_K']}",
                            sig, const, {"num_warps": G.QUANTIZE_TILES["num_warps"]}, targets))  # fmt: skip
    tiles = {k: v for k, v in G.ACT_TILES.items() if k.startswith("BLOCK")}
    options = {k: v for k, v in G.ACT_TILES.items() if k.startswith("num")}
    for element, activation in (("fp8_e4m3", "gelu_tanh"), ("fp6_e2m3", "gelu_tanh"), ("fp6_e2m3", "swiglu"),
                                ("fp4_e2m1", "gelu_tanh")):  # fmt: skip
        sig = _signature(
            "A", "A_SCALE", "B", "B_SCALE", "BIAS", "C_CODES", "C_SCALE", "M", "N", "K", "stride_a", "stride_as",
            "stride_b", "stride_bs", "stride_c", "stride_cs", A="*u8", A_SCALE="*u8", B="*u8", B_SCALE="*u8",
            BIAS="*bf16", C_CODES="*u8", C_SCALE="*u8",
        )  # fmt: skip
        const = _constexprs(sig, ELEMENT=G.ELEMENTS[element], ACTIVATION=G.ACTIVATIONS[activation], HAS_BIAS=True,
                            **G.element_constants(element), RCEIL=True, **tiles)  # fmt: skip
        config = f"{element}, {activation}, {tiles['BLOCK_M']}x{tiles['BLOCK_N']}x{tiles['BLOCK_K']} tiles"
        builds.append(Build("mx_gemm_triton._mx_gemm_act_kernel", config, sig, const, options, ("gfx950",),
                            {"gfx950": (MFMA_SCALED,)}))  # fmt: skip
    return builds


def _gluon_builds() -> list[Build]:
    from triton.experimental.gluon import language as gl

    from ditrun.kernels import attention_gluon

    d, block_n, builds = FLUX["head_dim"], 128, []
    for v_fp8 in (False, True):
        blocks = attention_gluon._blocks(d, block_n, gl.float8e4nv if v_fp8 else gl.bfloat16)
        v_element = "fp8e4nv" if v_fp8 else "bf16"
        element = {"q": "i8", "k": "i8", "ks": "fp32", "v": v_element, "ones": v_element}
        sig = {
            f"{name}_desc": f"tensordesc<{element[name]}{shape},{layout!r}>" for name, (shape, layout) in blocks.items()
        }
        sig |= _signature(
            "QS", "VS", "O", "S", "S_KS", "sm_scale_log2", QS="*fp32", VS="*fp32", O="*bf16", sm_scale_log2="fp32"
        )
        const = _constexprs(sig, D=d, BLOCK_N=block_n, STAGES=4, EVEN=True, V_FP8=v_fp8)
        wgmma = (WGMMA_S8, r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.e4m3\.e4m3" if v_fp8 else WGMMA_BF16)
        config = f"D={d}, BLOCK_N={block_n}, 4 stages, {'FP8' if v_fp8 else 'BF16'} V"
        builds.append(
            Build(
                "attention_gluon._int8qk_kernel",
                config,
                sig,
                const,
                {"num_warps": 4},
                ("sm_90a",),
                {"sm_90a": wgmma},
                True,
            )
        )
    return builds


def builds() -> list[Build]:
    """Every shipped kernel at the configurations CI builds (the Gluon kernel where this Triton has its API)."""
    found = _quantizer_builds() + _attention_builds() + _qk_producer_builds() + _mx_gemm_builds() + _mx_fused_builds()
    try:
        found += _gluon_builds()
    except (ImportError, AttributeError):  # this Triton lacks the Gluon Hopper API: the op runs the Triton kernel
        pass
    return found


NOT_BUILT = {
    "quantize_triton._mx_repack_kernel": "AMD: MX operands on ROCm go to mx_scaled_mm or mx_triton on gfx950 "
    "(linear.MxRepackFp8 is for CUDA GPUs without MX hardware)",
    "attention_triton._head_amax_kernel": "AMD: writes the Hopper Gluon kernel's FP8 V operand; runs only with it",
    "attention_triton._fp8_v_codes_kernel": "AMD: writes the Hopper Gluon kernel's FP8 V operand; runs only with it",
    "attention_gluon._int8qk_kernel": "AMD: written for Hopper (warpgroup wgmma, TMA descriptors, NVMMASharedLayout "
    "shared memory), none of which CDNA has; ROCm runs attention_triton._attention_forward",
    "mx_gemm_triton._mx_gemm_kernel": "gfx942: no scaled MFMA (Triton would emulate the scaled dot in BF16); the "
    "backend (linear.MxTriton) runs on gfx950 only",
    "mx_gemm_triton._mx_gemm_act_kernel": "gfx942, sm_90a: the mx_triton backend's fused MLP runs on gfx950 only "
    "(Hopper's MX linears are mx_repack_fp8)",
}
"""Kernel -> why a target of ``TARGETS`` missing from its ``targets`` never gets it."""


@dataclass
class Built:
    """What one build's machine code holds."""

    build: Build
    target: str
    code: str
    """AMDGCN assembly (AMD) or PTX (sm_90a)."""
    matrix: dict[str, int]
    """Matrix instruction -> how many the code holds (``v_mfma*``; ``wgmma.mma_async*`` shapes)."""
    registers: int | None = None
    """VGPRs (AMD: architectural + accumulation) or registers per thread (sm_90a, where cuobjdump is at hand)."""
    spills: int | None = None
    """Registers spilled to memory: AMD's VGPR spill count; sm_90a: bytes of local memory."""
    sgpr_spills: int = 0
    """AMD: scalar registers spilled into VGPR lanes (register moves, no memory traffic)."""
    scratch: int | None = None
    """Scratch (private) bytes per work item (AMD) or stack bytes per thread (sm_90a)."""
    occupancy: int | None = None
    """AMD: waves per SIMD the register use allows (the compiler's estimate)."""
    loop_matrix: dict[str, int] = field(default_factory=dict)
    """AMD: the matrix instructions one wave issues per pass of the loop that holds the most (the K loop)."""
    lds: int = 0
    """Shared memory / LDS bytes per workgroup (Triton's allocation)."""
    seconds: float = 0.0


def compile_build(build: Build, target: str) -> Built:
    """Build ``build`` for ``target`` with this machine's Triton (no GPU) and read its machine code."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget

    start = time.perf_counter()
    compiled = triton.compile(build.source(target), target=GPUTarget(*TARGETS[target]), options=build.options)
    seconds = time.perf_counter() - start
    if target.startswith("gfx"):
        built = _amd_facts(build, target, compiled.asm["amdgcn"])
    else:
        built = _nvidia_facts(build, target, compiled.asm["ptx"], compiled.asm["cubin"])
    built.lds, built.seconds = compiled.metadata.shared, seconds
    return built


def _count(pattern: str, code: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for instruction in re.findall(pattern, code):
        found[instruction] = found.get(instruction, 0) + 1
    return found


def _field(pattern: str, code: str) -> int:
    """The integer after ``pattern`` in the code object's notes (the kernel's entry), summed where it repeats."""
    return sum(int(value) for value in re.findall(pattern + r"\s*(\d+)", code))


def _amd_facts(build: Build, target: str, amdgcn: str) -> Built:
    return Built(
        build,
        target,
        amdgcn,
        _count(r"\bv_mfma\w*", amdgcn),
        registers=_field(r"\.vgpr_count:", amdgcn),
        spills=_field(r"\.vgpr_spill_count:", amdgcn),
        sgpr_spills=_field(r"\.sgpr_spill_count:", amdgcn),
        scratch=_field(r"\.private_segment_fixed_size:", amdgcn),
        occupancy=_field(r"; Occupancy:", amdgcn),
        loop_matrix=_loop_matrix(amdgcn),
    )


def _loop_matrix(amdgcn: str) -> dict[str, int]:
    """The ``v_mfma*`` counts of the loop (a label and a later branch back to it) that holds the most."""
    lines = amdgcn.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\.LBB\w+):", line))}
    best: dict[str, int] = {}
    for i, line in enumerate(lines):
        m = re.search(r"\bs_c?branch\w*\s+(\.LBB\w+)", line)
        if m and labels.get(m.group(1), i) < i:
            found = _count(r"\bv_mfma\w*", "\n".join(lines[labels[m.group(1)] : i]))
            best = max(best, found, key=lambda counts: sum(counts.values()))
    return best


def _nvidia_facts(build: Build, target: str, ptx: str, cubin: bytes) -> Built:
    built = Built(
        build, target, ptx, _count(r"wgmma\.mma_async\.sync\.aligned\.[\w.]+|\bmma\.sync\.aligned\.[\w.]+", ptx)
    )
    usage = _cubin_resources(cubin)
    if usage:
        built.registers, built.spills, built.scratch = usage.get("REG"), usage.get("LOCAL"), usage.get("STACK")
    return built


def _cubin_resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin's kernel (``cuobjdump -res-usage``, shipped with Triton); empty where
    it is missing."""
    from triton.backends.nvidia import compiler

    tool = Path(compiler.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists() and shutil.which("cuobjdump") is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool) if tool.exists() else "cuobjdump", "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def problems(built: Built) -> list[str]:
    """What in ``built``'s machine code falls short of the design: a matrix instruction missing, and on AMD VGPRs
    spilled, scratch, more VGPRs than a wave holds or more LDS than a workgroup gets. (SGPRs spilled into VGPR lanes
    and sm_90a's stack are reported, not counted here: neither is memory traffic on AMD, and the sm_90a builds are
    checked on the H100.)"""
    family = "amd" if built.target.startswith("gfx") else built.target
    wanted = built.build.instructions.get(built.target, built.build.instructions.get(family, ()))
    found = [f"no {pattern}" for pattern in wanted if not any(re.fullmatch(pattern, i) for i in built.matrix)]
    if built.target.startswith("gfx"):
        if built.spills:
            found.append(f"{built.spills} VGPRs spilled")
        if built.scratch:
            found.append(f"{built.scratch} bytes of scratch")
        if built.registers > VGPRS:
            found.append(f"{built.registers} VGPRs (a wave holds {VGPRS})")
        if built.lds > LDS_BYTES[built.target]:
            found.append(f"{built.lds} bytes of LDS ({built.target} has {LDS_BYTES[built.target]})")
    return found
