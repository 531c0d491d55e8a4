"""The cost of the layout code itself: one CFG denoising step of ``ulysses`` on one GPU (P=1)
against ``single``, FLUX.1-dev geometry, random bf16 weights.

With an SP group of one nothing is exchanged, so any difference is what the parallel path
adds on its own: slicing the inputs into shards, the attention wrapper, the velocity gather
and, with head groups, one attention call per group. The target is at most 3% over
``single``. Layouts are timed in alternation (A, B, C, A, B, C, ...) so that clock and
thermal drift hit all of them alike; each row is the median of ``--repeats`` steps.

    python benchmarks/bench_layouts.py --width 1024 --height 1024 --out results/bench

Needs a CUDA/ROCm GPU with ~30 GB free; exits 0 with a message otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditrun.metrics.timing import ExposedTransfer  # noqa: E402
from ditrun.model.latents import token_ids  # noqa: E402
from ditrun.model.load import random_model  # noqa: E402
from ditrun.model.presets import PRESETS  # noqa: E402
from ditrun.model.sampler import EditInputs  # noqa: E402
from ditrun.parallel.cfg import layout_velocity  # noqa: E402
from ditrun.parallel.layout import build_layout, plan_layout  # noqa: E402
from ditrun.config import TransportConfig  # noqa: E402
from ditrun.transport.registry import make_transport  # noqa: E402

FLUX_DEV = PRESETS["flux-dev"]
# (layout, head_groups): the first row is the baseline.
ROWS = [("single", 1), ("ulysses", 1), ("ulysses", 2), ("cfg_batch", 1)]
TARGET_PCT = 3.0


class LayoutArgs:
    """The three ``layout.*`` keys, without composing a whole run config."""

    def __init__(self, name: str, head_groups: int):
        self.name, self.replicas, self.head_groups = name, 1, head_groups


def edit_inputs(width: int, height: int, text_len: int) -> EditInputs:
    """A Kontext-style edit: output tokens, as many reference tokens, text, on the GPU."""
    h, w = height // 8, width // 8
    n = (h // 2) * (w // 2)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    return EditInputs(
        noise=randn(1, n, 64), ref_latents=randn(1, n, 64), img_ids=token_ids(h, w, 0, "cuda"),
        ref_ids=token_ids(h, w, 1, "cuda"), prompt=randn(1, text_len, FLUX_DEV.joint_attention_dim),
        pooled=randn(1, FLUX_DEV.pooled_projection_dim), neg_prompt=randn(1, text_len, FLUX_DEV.joint_attention_dim),
        neg_pooled=randn(1, FLUX_DEV.pooled_projection_dim), txt_ids=torch.zeros(text_len, 3, device="cuda"),
    )


def step_function(model, inputs: EditInputs, name: str, head_groups: int):
    """One CFG step's velocity under ``name`` on this one GPU."""
    layout = build_layout(plan_layout(LayoutArgs(name, head_groups), 1, FLUX_DEV.num_attention_heads))
    timer = ExposedTransfer(torch.device("cuda"))
    transports = {axis: make_transport(TransportConfig(), layout.groups[axis], timer, torch.device("cuda"), 60.0)
                  for axis in ("sp", "cfg")}
    dtype = next(model.parameters()).dtype
    velocity = layout_velocity(layout, transports, model, inputs, 2.5, 3.5, dtype)
    return lambda: velocity(inputs.noise, 0.6)


def time_once(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_layouts: no CUDA/ROCm GPU visible; nothing to measure.")
        return 0

    model = random_model(FLUX_DEV, seed=0, dtype=torch.bfloat16, device="cuda")
    inputs = edit_inputs(args.width, args.height, args.text_len)
    steps = {row: step_function(model, inputs, *row) for row in ROWS}
    times: dict = {row: [] for row in ROWS}
    with torch.inference_mode():
        outputs = {row: fn().float() for row, fn in steps.items()}  # warm-up, and the outputs to compare
        for _ in range(args.repeats):
            for row, fn in steps.items():
                times[row].append(time_once(fn))
    report = summarise(times, outputs, args)
    print_table(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_layouts.json").write_text(json.dumps(report, indent=2))
    return 0


def summarise(times: dict, outputs: dict, args) -> dict:
    base = statistics.median(times[ROWS[0]])
    reference = outputs[ROWS[0]]
    rows = []
    for (name, groups), samples in times.items():
        step_s = statistics.median(samples)
        error = ((outputs[(name, groups)] - reference).abs().max() / reference.abs().max()).item()
        rows.append({"layout": name, "head_groups": groups, "step_s": step_s,
                     "overhead_pct": 100 * (step_s / base - 1), "max_rel_error_vs_single": error})
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "width": args.width,
            "height": args.height, "text_len": args.text_len, "repeats": args.repeats,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9, "rows": rows}


def print_table(report: dict) -> None:
    n = (report["width"] // 16) * (report["height"] // 16)
    print(f"\nFLUX.1-dev geometry, random bf16 weights, {report['width']}x{report['height']} edit "
          f"({n} output + {n} reference tokens, {report['text_len']} text), one CFG step (both branches), "
          f"{report['device']}, torch {report['torch']}, median of {report['repeats']}")
    print(f"{'layout':<10} {'head groups':>11} {'step s':>8} {'vs single':>10} {'rel. error':>11}")
    for row in report["rows"]:
        print(f"{row['layout']:<10} {row['head_groups']:>11} {row['step_s']:>8.4f} {row['overhead_pct']:>+9.1f}% "
              f"{row['max_rel_error_vs_single']:>11.1e}")
    ulysses = next(r for r in report["rows"] if (r["layout"], r["head_groups"]) == ("ulysses", 1))
    verdict = "within" if ulysses["overhead_pct"] <= TARGET_PCT else "OVER"
    print(f"ulysses (P=1, 1 head group) vs single: {ulysses['overhead_pct']:+.1f}%, {verdict} the "
          f"{TARGET_PCT:.0f}% target")


if __name__ == "__main__":
    sys.exit(main())
