"""A scaling model to 64 nodes x 8 GPUs, fed by measured numbers: latency per edit, throughput, makespan.

    python3 benchmarks/scaling.py                       # print the tables (markdown)
    python3 benchmarks/scaling.py RUN_DIR ... --write-docs   # add run directories, regenerate docs/SCALING.md
    python3 benchmarks/scaling.py --json model.json     # every cell as JSON too (the tests read it)
    python3 benchmarks/scaling.py --measure DIR         # GPU: run the published shape first, then compare

The inputs, the model and its rules: ``benchmarks/scaling_model.py``. The rules and every assumption are
printed above the tables (``assumptions``) and in docs/SCALING.md; cells marked M are measured points, the others are
modelled.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Optional

from scaling_model import (
    BF16_BYTES,
    FALLBACK_STARTUP_S,
    MEASURED_FILE,
    NODES,
    ROOT,
    RUNS_DIR,
    STARTUP_FILE,
    WORKLOADS,
    Cell,
    Inputs,
    Model,
    Scenario,
    build,
    find_run_dirs,
    model_cells,
    point_from_run,
    point_shape,
    qkv_ratio,
    rows_of,
)

DOC_FILE = ROOT / "docs" / "SCALING.md"
BEGIN_MARK = "<!-- scaling.py: begin generated tables -->"
END_MARK = "<!-- scaling.py: end generated tables -->"


def as_json(model: Model, scenarios: list[Scenario]) -> dict:
    out = {"assumptions": assumptions(model), "scenarios": []}
    for scenario in scenarios:
        cells = []
        for cell in model_cells(model, scenario):
            by_nodes = {
                n: {
                    "replicas": model.replicas(n, cell.gpus),
                    "throughput": model.throughput(scenario, cell, n),
                    "round_s": model.makespan_s(scenario, cell, n, model.replicas(n, cell.gpus), startup=False),
                    "startup_s": model.startup_s(scenario, cell.precision, n),
                    "makespan_s": {e: model.makespan_s(scenario, cell, n, e) for e in WORKLOADS},
                    "makespan_compute_s": {e: model.makespan_s(scenario, cell, n, e, startup=False) for e in WORKLOADS},
                }
                for n in NODES
            }
            cells.append({**cell.__dict__, "latency_s": model.latency_s(scenario, cell), "nodes": by_nodes})
        out["scenarios"].append(
            {
                "name": scenario.name,
                "device": scenario.device,
                "steps": scenario.steps,
                "shape": scenario.shape.__dict__,
                "cells": cells,
            }
        )
    return out


def assumptions(model: Model) -> list[str]:
    inputs = model.inputs
    lines = [
        "Latency per edit = steps x (one-GPU step / (GPUs per edit x compute efficiency) + exposed transfer per step) "
        "+ encode and decode (image load, VAE, prompt embeddings: the encode_s + decode_s medians of a run directory "
        "of the same shape with real VAE weights, not divided by SP); without such a run they are excluded, as for "
        "every input so far (random weights, the linear latent map, stand-in prompt embeddings).",
        "One-GPU step: a measured point of the same device, shape and precision (M); else the bf16 step plus, per "
        "forward, the measured kernel-time differences of the precision's GEMMs (linear in M between the measured M) "
        "and attention (measured sequence lengths only), counted per layer. The fp8 GEMMs include their activation "
        "quantizer; their speedup at M = S is assumed to hold at the per-rank M = S/P.",
        "Compute efficiency: taken from the measured multi-GPU point of each layout with the best speedup, and held "
        "for every GPU count (optimistic for P = 4, 8: smaller per-rank GEMMs are less efficient); cfg_split on g "
        "GPUs = its measured CFG efficiency x Ulysses' efficiency for P = g/2 >= 2. Without true CFG, cfg_batch "
        "runs as ulysses and cfg_split is refused (docs/WORKLOAD.md).",
        "All-to-all per exchange = latency + MB to peers / bandwidth, a least-squares line through the measured "
        "2-GPU messages; per attention each rank sends (P-1)/P of its S/P-token shard twice (Q, K, V: 3 x hidden; "
        "output: 1 x hidden; bf16), as G head-group messages; per step x blocks x passes (ulysses: one per CFG "
        "branch; cfg_batch: one of batch 2; cfg_split: one branch per group of g/2). The per-rank bandwidth "
        "measured between 2 GPUs is held at P = 4 and 8 (an NVSwitch or full-mesh node).",
        "Quantized exchange (krea, the default precision.quantized_exchange): Q, K and V cross as their attention "
        "format's codes and scales, the qkv message "
        + qkv_ratio_text(inputs)
        + " of the bf16 one's (the payload's record, what the transports count), after one more message per block "
        "(every rank's fp64 statistics); krea+bf16x is krea exchanging bf16 (quantized_exchange=false), for "
        "comparison. A run directory's own ratio is the bytes its transports counted.",
        "Exposed transfer per step = the reference point's exposed fraction of that modelled all-to-all time, at the "
        "new P and size; cfg_split's prediction swap and velocity gather keep their measured seconds, scaled by "
        "output tokens. Head groups: the reference's, raised to the next divisor of the heads per rank (24 heads: "
        "3 per rank at P = 8).",
        "SP and CFG groups never span nodes (8 GPUs per node), so latency per edit does not depend on the node "
        "count; replicas = nodes x 8 / GPUs per edit; steady throughput = replicas / latency (exactly linear in "
        "nodes).",
        "Makespan of N edits = start-up(nodes) + weights load + first-edit warm-up of the precision + ceil(N / "
        "replicas) x latency: edits are dealt to replicas round robin, so the last round may be partial (the tail); "
        "past N replicas more nodes cannot lower it, only more GPUs per edit can.",
        f"Start-up: {inputs.startup.source}.",
        f"Weights load (built-in FLUX.1-dev scenarios): {inputs.weights_load['s']} s, {inputs.weights_load['source']}; "
        "assumed the same on every node (each node reads its own copy at that speed).",
        "First-edit warm-up per precision (once per run, replicas warm up in parallel): "
        + "; ".join(f"{p} {v['s']} s ({v['source']})" for p, v in inputs.first_edit_extra.items())
        + ".",
    ]
    for device, link in inputs.link.items():
        lines.append(
            f"All-to-all on {device}: {link.latency_ms * 1e3:.0f} us + MB / {link.gb_per_s:.0f} GB/s, "
            f"fitted to {link.source}."
        )
    return lines


def qkv_ratio_text(inputs: Inputs) -> str:
    """'x 0.51 (int8qk_mxfp6v)' for each quantized attention of the committed precisions, head dim 128, bf16."""
    head_dim = inputs.geometry.hidden // inputs.geometry.heads
    formats = sorted({f["attention"] for f in inputs.precisions.values() if f["attention"] != "bf16"})
    return ", ".join(f"x {qkv_ratio(a, head_dim, BF16_BYTES):.3f} ({a}, head dim {head_dim})" for a in formats)


def fmt_s(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def mark(text: str, measured: bool) -> str:
    return f"**{text} M**" if measured else text


def row_label(cell: Cell) -> str:
    groups = f", G={cell.head_groups}" if cell.sp_degree > 1 else ""
    if cell.layout == "cfg_split":
        return f"cfg_split ({cell.gpus} GPUs: 2 x P={cell.sp_degree}{groups})"
    if cell.layout == "single":
        return "single (1 GPU)"
    return f"{cell.layout} (P={cell.sp_degree}{groups})"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def per_edit_table(model: Model, scenario: Scenario, cells: list[Cell]) -> str:
    rows = []
    for cell in cells:
        latency = model.latency_s(scenario, cell)
        exposed_pct = 100.0 * cell.exposed_step_s / cell.step_s
        rows.append(
            [
                row_label(cell),
                cell.precision,
                mark(f"{cell.step_s:.4f}", cell.measured),
                mark(fmt_s(latency), cell.measured),
                f"{exposed_pct:.1f}%",
                f"{model.throughput(scenario, cell, 1):.3f}",
            ]
        )
    return md_table(
        ["layout", "precision", "s / step", "latency s / edit", "exposed", "edits/s per node (x nodes)"], rows
    )


def makespan_table(model: Model, scenario: Scenario, cells: list[Cell], edits: int) -> str:
    rows = []
    for cell in cells:
        values = []
        for n in NODES:
            seconds = model.makespan_s(scenario, cell, n, edits)
            rate = f" ({edits / seconds:.2f}/s)" if edits >= 1000 else ""
            values.append(fmt_s(seconds) + rate + (" *" if model.replicas(n, cell.gpus) >= edits else ""))
        rows.append([f"{row_label(cell)}, {cell.precision}"] + values)
    return md_table(["layout, precision"] + [f"{n} node{'s' if n > 1 else ''}" for n in NODES], rows)


def published_line(model: Model, scenario: Scenario) -> str:
    """The published figures of this shape, if any, for comparison (they feed no cell)."""
    published = model.inputs.published
    if not published or point_shape(published) != scenario.shape:
        return ""
    rows = "; ".join(f"{r['what']}: {r['dit_s']} s per edit on {r['gpus']} {r['device']}" for r in published["rows"])
    return f" For comparison, not an input: {rows} ({published['steps']} steps; {published['source']})."


def derived_table(model: Model, scenarios: list[Scenario]) -> str:
    """What the model takes from each layout's reference point: compute efficiency e and exposed fraction f."""
    rows = []
    for scenario in scenarios:
        for layout in dict.fromkeys(layout for layout, gpus in rows_of(scenario) if gpus > 1):
            ref = model.reference(scenario.device, layout, scenario.shape)
            if ref is None:
                continue
            point, one_gpu = ref
            fraction = model.exposed_fraction(point) if layout != "cfg_split" else None
            rows.append(
                [
                    scenario.name.split(":")[0].split(" (")[0],
                    layout,
                    f"{point.gpus} GPUs, G={point.head_groups}, {point.precision}, {point.shape.tokens} tokens"
                    f"{', true CFG' if point.shape.true_cfg else ''}",
                    f"{one_gpu / point.step_s:.2f}x",
                    f"{model.efficiency(point, one_gpu):.3f}",
                    "-" if fraction is None else f"{fraction:.2f}",
                ]
            )
    return md_table(["scenario", "layout", "reference point (measured)", "speedup", "e", "f"], rows)


def render(model: Model, scenarios: list[Scenario]) -> str:
    parts = [
        "### Assumptions (generated)",
        "",
        *[f"{i}. {a}" for i, a in enumerate(assumptions(model), 1)],
        "",
        "Cells in **bold with M** are measured points (s / step as measured; latency = steps x that, + encode and "
        "decode where measured); every "
        "other cell is modelled. Makespans include start-up, weights load and warm-up; throughput per node "
        "excludes them. A makespan marked * is one round: there are at least as many replicas as edits, "
        "so more nodes cannot shorten it.",
        "",
        "Taken from each layout's reference point (e: compute efficiency; f: exposed share of the modelled "
        "all-to-all time, which can exceed 1 since the exposed time also holds the velocity gather and waits "
        "for a slower peer; cfg_split's reference has no all-to-all: its exposed seconds are kept, and its "
        "all-to-all at P = g/2 takes Ulysses' f):",
        "",
        derived_table(model, scenarios),
        "",
    ]
    for scenario in scenarios:
        cells = model_cells(model, scenario)
        fixed = model.fixed_s(scenario)
        fixed_text = "excluded (not measured)" if fixed is None else f"{fixed:.3f} s, measured"
        parts += [
            f"### {scenario.name}",
            "",
            f"{scenario.device}; {scenario.shape.label()} (S = "
            f"{scenario.shape.tokens} per forward); VAE and text encoders per edit: {fixed_text}."
            + (
                ""
                if scenario.shape.true_cfg
                else " True CFG off: `cfg_batch` runs as `ulysses` (one branch, "
                "batch 1) and `cfg_split` is refused, so neither has rows."
            )
            + published_line(model, scenario),
            "",
            "Per edit (does not depend on the node count):",
            "",
            per_edit_table(model, scenario, cells),
            "",
        ]
        if not cells:
            continue
        for edits in WORKLOADS:
            what = "makespan s" + (" (edits/s over the whole run)" if edits >= 1000 else "")
            parts += [
                f"{edits:,} edits, {what}, nodes x 8 GPUs:",
                "",
                makespan_table(model, scenario, cells, edits),
                "",
            ]
    return "\n".join(parts)


def write_docs(text: str, doc: Path = DOC_FILE) -> None:
    """Replace what lies between the markers of ``doc`` with ``text``: the doc's tables are never hand-edited."""
    current = doc.read_text()
    pattern = re.compile(re.escape(BEGIN_MARK) + ".*?" + re.escape(END_MARK), re.S)
    if not pattern.search(current):
        raise SystemExit(f"{doc} has no '{BEGIN_MARK}' ... '{END_MARK}' markers")
    doc.write_text(pattern.sub(lambda _: f"{BEGIN_MARK}\n{text}\n{END_MARK}", current))


# ---------------------------------------------------------------------------------------------
# GPU runs that feed the model, each beside what the model predicted without it

# (folder name, GPUs per edit, ditrun overrides): the published shape (true CFG off), run with every
# configuration the visible GPUs allow; P = 4 and 8 only where 4 or 8 GPUs are visible.
MEASURE_RUNS = (
    ("single-bf16", 1, ()),
    ("single-fp8", 1, ("precision=fp8",)),
    ("ulysses-p2-g1-bf16", 2, ("layout=ulysses",)),
    ("ulysses-p2-g2-bf16", 2, ("layout=ulysses", "layout.head_groups=2")),
    ("ulysses-p4-g2-bf16", 4, ("layout=ulysses", "layout.head_groups=2")),
    ("ulysses-p8-g3-bf16", 8, ("layout=ulysses", "layout.head_groups=3")),
)
MEASURE_BASE = (
    "workload=benchmark",
    "model=flux-dev",
    "workload.limit=2",
    "metrics.ssim=false",
    "metrics.report=false",
    "wandb.mode=disabled",
    "progress=false",
)
RUN_FILES = ("summary.json", "edits.jsonl")


def measure(out: Path, steps: int, only: list[str], timeout_s: float) -> list[Path]:
    """Run each configuration of ``MEASURE_RUNS`` that fits the visible GPUs; keep its two files under ``out``."""
    import os
    import shutil
    import subprocess
    import tempfile

    import torch

    visible = torch.cuda.device_count()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1"}
    kept = []
    for name, gpus, overrides in MEASURE_RUNS:
        if only and name not in only:
            continue
        if gpus > visible:
            print(f"scaling: {name} not run ({gpus} GPUs needed, {visible} visible)", file=sys.stderr)
            continue
        run_dir = Path(tempfile.mkdtemp(prefix=f"scaling-{name}-"))
        command = [
            sys.executable,
            "-m",
            "ditrun",
            *MEASURE_BASE,
            f"workload.steps={steps}",
            f"launcher.world={gpus}",
            *overrides,
            f"hydra.run.dir={run_dir}",
        ]
        print("$", " ".join(command), file=sys.stderr, flush=True)
        try:
            done = subprocess.run(command, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"scaling: {name} ran past {timeout_s:.0f} s; left out", file=sys.stderr)
            continue
        if done.returncode != 0 or not (run_dir / "summary.json").is_file():
            print(f"scaling: {name} failed (exit {done.returncode}); left out", file=sys.stderr)
            continue
        device = json.loads((run_dir / "summary.json").read_text())["device"]
        device_slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
        dest = out / f"{time.strftime('%Y-%m-%d')}-{device_slug}-published-{name}"
        dest.mkdir(parents=True, exist_ok=True)
        for file in RUN_FILES:
            shutil.copy(run_dir / file, dest / file)
        kept.append(dest)
    return kept


def prediction_table(before: Model, scenarios: list[Scenario], run_dirs: list[Path]) -> str:
    """Each new run's seconds per step beside the cell the model gave without it (M: it was measured already)."""
    rows = []
    for run_dir in run_dirs:
        point = point_from_run(run_dir)
        scenario = next((s for s in scenarios if (s.device, s.shape) == (point.device, point.shape)), None)
        cell = before.cell(scenario, point.layout, point.gpus, point.precision) if scenario else None
        predicted = "-" if cell is None else mark(f"{cell.step_s:.4f}", cell.measured) + f" (G={cell.head_groups})"
        ratio = "-" if cell is None else f"{point.step_s / cell.step_s:.3f}"
        rows.append(
            [
                run_dir.name,
                f"{point.layout} x{point.gpus}, G={point.head_groups}, {point.precision}",
                predicted,
                f"{point.step_s:.4f}",
                f"{100 * point.exposed_step_s / point.step_s:.1f}%",
                ratio,
            ]
        )
    return md_table(
        ["run", "configuration", "model before it, s / step", "measured s / step", "exposed", "measured / model"], rows
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="ditrun run directories (or folders holding them)")
    parser.add_argument("--measured", type=Path, default=MEASURED_FILE)
    parser.add_argument("--startup", type=Path, default=STARTUP_FILE)
    parser.add_argument("--no-default-runs", action="store_true", help=f"do not read {RUNS_DIR.relative_to(ROOT)}/")
    parser.add_argument("--json", type=Path, help="also write every cell as JSON here")
    parser.add_argument(
        "--write-docs", action="store_true", help=f"regenerate the tables in {DOC_FILE.relative_to(ROOT)}"
    )
    parser.add_argument(
        "--measure",
        type=Path,
        metavar="DIR",
        help="GPU: first run the published shape in every configuration the GPUs allow, keep the run "
        "directories under DIR and print each beside the model's prediction without it",
    )
    parser.add_argument("--steps", type=int, default=6, help="--measure: denoising steps per edit (2 edits a run)")
    parser.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="--measure: only these of " + ", ".join(name for name, _, _ in MEASURE_RUNS),
    )
    parser.add_argument("--run-timeout", type=float, default=300.0, help="--measure: seconds per ditrun run")
    args = parser.parse_args(argv)
    run_dirs = find_run_dirs(args.runs + ([] if args.no_default_runs else [RUNS_DIR]))
    if not args.startup.is_file():
        print(
            f"scaling: {args.startup} is missing; start-up assumed {FALLBACK_STARTUP_S:.0f} s at every node count",
            file=sys.stderr,
        )
    new_runs = measure(args.measure, args.steps, args.only, args.run_timeout) if args.measure else []
    model, scenarios = build(args.measured, run_dirs + new_runs, args.startup)
    text = render(model, scenarios)
    print(text)
    if new_runs:
        print("\n### The new runs beside the model without them\n")
        print(prediction_table(build(args.measured, run_dirs, args.startup)[0], scenarios, new_runs))
    if args.json:
        args.json.write_text(json.dumps(as_json(model, scenarios), indent=1))
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
