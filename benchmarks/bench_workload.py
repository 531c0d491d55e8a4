"""The published Kontext benchmark's shape through the whole ditrun CLI, beside the published figures.

    python3 benchmarks/bench_workload.py [--limit 2] [--steps 28] [--out DIR] [-- extra ditrun overrides]

Runs ``ditrun workload=benchmark model=flux-dev`` (FLUX.1-dev geometry, seeded random bf16 weights,
1 MP references + 4 MP outputs: 4096 + 16384 image tokens and 512 text tokens, true CFG off) on
the first ``--limit`` edits, without SSIM references (they would triple the time), and prints
DiT seconds per edit (median after the first, warm-up, edit) beside the published MI355X
figures: 22.9 s (BF16 baseline) and 3.3 s (optimized), both at 28 steps. With ``--steps`` below
28 the time is also given per step and extrapolated to 28 (every step costs the same: same
tokens, same kernels). The published figures are another GPU (AMD MI355X), so the ratio
compares hardware and software together.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PUBLISHED_STEPS = 28
PUBLISHED_S = {"published BF16 baseline (MI355X)": 22.9, "published optimized (MI355X)": 3.3}


def run_ditrun(model: str, limit: int, steps: int, out: Path, extra: list[str]) -> dict:
    command = [
        sys.executable,
        "-m",
        "ditrun",
        "workload=benchmark",
        f"model={model}",
        f"workload.limit={limit}",
        f"workload.steps={steps}",
        "metrics.ssim=false",
        "metrics.report=false",
        "wandb.mode=disabled",
        "progress=false",
        f"hydra.run.dir={out}",
        *extra,
    ]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads((out / "summary.json").read_text())


def table(summary: dict, steps: int) -> list[tuple[str, str, str, str]]:
    """(row, seconds per edit at 28 steps, seconds per step, ratio to ours) for ours and the published."""
    ours = summary["dit_s_median"] * PUBLISHED_STEPS / steps
    measured = "measured" if steps == PUBLISHED_STEPS else f"extrapolated from {steps} steps"
    rows = [(f"ditrun, {summary['device']} ({measured})", f"{ours:.2f}", f"{ours / PUBLISHED_STEPS:.3f}", "1.00x")]
    rows += [(name, f"{s:.2f}", f"{s / PUBLISHED_STEPS:.3f}", f"{ours / s:.2f}x") for name, s in PUBLISHED_S.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux-dev", help="model preset (tiny: a CPU check of the script)")
    parser.add_argument("--limit", type=int, default=2, help="edits to run (the first is the warm-up)")
    parser.add_argument("--steps", type=int, default=PUBLISHED_STEPS)
    parser.add_argument("--out", type=Path, default=None, help="where the JSON table goes")
    parser.add_argument("extra", nargs="*", help="more ditrun overrides (after --)")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-workload-"))
    summary = run_ditrun(args.model, args.limit, args.steps, run_dir, args.extra)
    rows = table(summary, args.steps)
    w = summary["config"]["workload"]
    print(
        f"\nworkload=benchmark: {summary['edits']} edits, {w['width']}x{w['height']} output + {w['ref_width']}x"
        f"{w['ref_height']} reference, {w['text_len']} text tokens, true_cfg_scale {w['true_cfg_scale']}, "
        f"{args.steps} steps, model={args.model}, random weights ({summary['dtype']})"
    )
    print(f"{'run':<58} {'DiT s / edit @28':>16} {'s / step':>9} {'ours / it':>9}")
    for row in rows:
        print(f"{row[0]:<58} {row[1]:>16} {row[2]:>9} {row[3]:>9}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_workload.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
