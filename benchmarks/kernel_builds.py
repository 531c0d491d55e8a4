"""What each shipped kernel compiles to on each GPU target, with no GPU: one row per build of ``kernels/builds.py``
(the Flux shapes) and target, with its matrix instructions, registers, spills, scratch, LDS and (AMD) occupancy,
read from the machine code this machine's Triton writes. A markdown table, for docs/PRECISION.md.

    python benchmarks/kernel_builds.py                 # every build, every target it is dispatched to
    python benchmarks/kernel_builds.py --kernel mx_gemm --target gfx950
    python benchmarks/kernel_builds.py --estimate 20992    # the MX GEMM's MFMA-bound time on MI355X, Flux MLP

Facts of the machine code, not measurements: nothing here ran, and nothing has run on AMD hardware.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from ditrun.kernels import builds as B
from ditrun.kernels import mx_gemm_triton as G

MI355X_CUS, MI355X_CLOCK_HZ = 256, 2.4e9
"""Compute units and peak engine clock (AMD's datasheet); each CU has four SIMDs, each issuing one MFMA at a time."""
SCALED_MFMA_CYCLES = {"e4m3": 64, "fp6": 32, "e2m1": 32}
"""Cycles of one ``v_mfma_scale_f32_32x32x64_f8f6f4`` by operand format, from the datasheet's dense peaks (FP8 5.0,
MXFP6 and MXFP4 10 PFLOP/s): 2 x 32 x 32 x 64 / (peak / (CUs x 4 x clock))."""


def matrix_class(built: B.Built) -> str:
    """The matrix instructions, each with its count in the code (static: a loop's body counts once)."""
    if not built.matrix:
        return "-"
    short = {name.replace("wgmma.mma_async.sync.aligned.", "wgmma."): n for name, n in built.matrix.items()}
    return ", ".join(f"`{name}` x{n}" for name, n in sorted(short.items()))


def row(built: B.Built) -> str:
    b = built
    spills = f"{b.spills}" + (f" (+{b.sgpr_spills} SGPR to VGPR lanes)" if b.sgpr_spills else "")
    cells = [
        f"`{b.build.name}`",
        b.build.config,
        b.target,
        matrix_class(b),
        "-" if b.registers is None else str(b.registers),
        "-" if b.spills is None else spills,
        "-" if b.scratch is None else str(b.scratch),
        str(b.lds),
        "-" if b.occupancy is None else str(b.occupancy),
        "; ".join(B.problems(b)) or "ok",
    ]
    return "| " + " | ".join(cells) + " |"


def estimate(tokens: int) -> None:
    """Each MX format's GEMMs of one Flux MLP (up 3072 -> 12288, down 12288 -> 3072) at ``tokens`` rows, bound by the
    scaled MFMAs the gfx950 code issues (its K loop's count per wave x waves x K tiles x tiles), on MI355X's peak
    clock with every SIMD busy; and native FP6's where the kernel carries FP6 as E4M3."""
    print("| format | MFMAs per K tile per wave | up + down, ms (estimate) | at FP6's rate, ms |")
    print("| --- | --- | --- | --- |")
    for build in B.builds():
        if build.name != "mx_gemm_triton._mx_gemm_kernel":
            continue
        built, c = B.compile_build(build, "gfx950"), build.constexprs
        (instruction, per_wave), *_ = built.loop_matrix.items()
        element = next(name for name, code in G.ELEMENTS.items() if code == c["ELEMENT"])
        issued = "e2m1" if element == "fp4_e2m1" else "e4m3"
        mfmas = 0
        for n, k in ((12288, 3072), (3072, 12288)):
            tiles = -(-tokens // c["BLOCK_M"]) * -(-n // c["BLOCK_N"])
            mfmas += tiles * (k // c["BLOCK_K"]) * per_wave * build.options["num_warps"]
        seconds = mfmas / (MI355X_CUS * 4 * MI355X_CLOCK_HZ)
        native = seconds * SCALED_MFMA_CYCLES["fp6"] if element.startswith("fp6") else None
        print(
            f"| {element} | {per_wave} `{instruction}` | {seconds * SCALED_MFMA_CYCLES[issued] * 1e3:.3f} | "
            f"{'-' if native is None else f'{native * 1e3:.3f}'} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", default="", help="only builds whose kernel name contains this")
    parser.add_argument("--target", choices=sorted(B.TARGETS), help="only this target")
    parser.add_argument("--estimate", type=int, metavar="TOKENS", help="the MX GEMM's MFMA-bound time instead")
    args = parser.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ditrun-kernel-builds-")  # built here, now
    if args.estimate:
        return estimate(args.estimate)
    columns = ["kernel", "configuration", "target", "matrix instructions", "VGPRs / regs", "spills", "scratch B"]
    print("| " + " | ".join(columns + ["LDS B", "waves/SIMD", "check"]) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for build in B.builds():
        if args.kernel not in build.name:
            continue
        for target in build.targets:
            if args.target in (None, target):
                print(row(B.compile_build(build, target)), flush=True)
    print()
    for name, why in B.NOT_BUILT.items():
        print(f"- `{name}` is not built for {why}")


if __name__ == "__main__":
    main()
