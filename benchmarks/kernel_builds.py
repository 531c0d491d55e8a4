"""What each shipped kernel compiles to on each GPU target, with no GPU: one row per build of ``kernels/builds.py``
(the Flux shapes) and target, with its matrix instructions, registers, spills, scratch, LDS and (AMD) occupancy,
read from the machine code this machine's Triton writes. A markdown table, for docs/PRECISION.md.

    python benchmarks/kernel_builds.py                 # every build, every target it is dispatched to
    python benchmarks/kernel_builds.py --kernel mx_gemm --target gfx950

Facts of the machine code, not measurements: nothing here ran, and nothing has run on AMD hardware.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from ditrun.kernels import builds as B


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", default="", help="only builds whose kernel name contains this")
    parser.add_argument("--target", choices=sorted(B.TARGETS), help="only this target")
    args = parser.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ditrun-kernel-builds-")  # built here, now
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
