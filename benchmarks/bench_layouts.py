"""The cost of the layout code itself: one CFG denoising step of ``ulysses`` on one GPU (P=1)
against ``single``, FLUX.1-dev geometry, random bf16 weights.

With an SP group of one nothing is exchanged, so any difference is what the parallel path
adds on its own: slicing the inputs into shards, the attention wrapper, the velocity gather
and, with head groups, one attention call per group. Layouts are timed in alternation
(A, B, C, A, B, C, ...) so that clock and thermal drift hit all of them alike; each row is the
median of ``--repeats`` steps.

    python benchmarks/bench_layouts.py --width 1024 --height 1024 --out results/bench

``--world 2`` instead runs two ranks (one per GPU; ``--share-gpu``: both on GPU 0 over a gloo
process group, copy_engine only, through CUDA IPC: NCCL refuses two ranks per GPU) and compares, in one run
and in alternation, every layout x transport (``collective``, ``copy_engine``) x head groups {1, 2} against
``single`` on the same inputs: the relative error of the guided velocity,
whether copy_engine's output is bitwise that of collective, the CFG step time, the exposed
transfer, and the DiT time of a ``--steps``-step edit. The last line gives ``ulysses`` with 2 head
groups over ``copy_engine``: its exposed share of the DiT time and how much faster it is than over
``collective``. The measured numbers and their reading: docs/PERFORMANCE.md.

    python benchmarks/bench_layouts.py --world 2 --out results/bench
    python benchmarks/bench_layouts.py --world 2 --layouts ulysses cfg_batch --head-groups 1 2 4

Each row also shows ``backlog ms``: how long the GPU still worked after the host had issued the
whole step. Near 0 means the GPU had been waiting for the host (the host's cost per exchange, not
the transfer, set the pace); a host that runs ahead leaves milliseconds of queued work (the
launch queue holds ~1000 operations), which is why the host's own issue time per step says
nothing: launches block once the queue is full.

Needs a CUDA/ROCm GPU with ~30 GB free (per rank); exits 0 with a message otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import LayoutArgs, edit_inputs, gpu_and_backlog_s

from ditrun.config import TransportConfig
from ditrun.model.load import random_model
from ditrun.model.presets import PRESETS
from ditrun.model.sampler import EditInputs, PlainForward
from ditrun.parallel.cfg import layout_velocity, prepare_transports
from ditrun.parallel.layout import plan_layout
from ditrun.parallel.placement import Placement, build_layout
from ditrun.timers import ExposedTransfer
from ditrun.transport.registry import make_transport

FLUX_DEV = PRESETS["flux-dev"]
# (layout, head_groups): the first row is the baseline.
ROWS = [("single", 1), ("ulysses", 1), ("ulysses", 2), ("cfg_batch", 1)]


def step_function(
    model, inputs: EditInputs, name: str, head_groups: int, world: int = 1, transport: str = "collective", timer=None
):
    """One CFG step's velocity under ``name`` over ``world`` ranks (every rank calls this, in one order)."""
    plan = plan_layout(LayoutArgs(name, head_groups), world if name != "single" else 1, FLUX_DEV.num_attention_heads)
    layout = build_layout(Placement.on_one_node(plan))
    device = torch.device("cuda", torch.cuda.current_device())
    timer = timer or ExposedTransfer(device)
    transports = {
        axis: make_transport(TransportConfig(name=transport), layout.groups[axis], timer, device, 120.0)
        for axis in ("sp", "cfg")
    }
    dtype = next(model.parameters()).dtype
    velocity = layout_velocity(layout, transports, PlainForward(model), inputs, 2.5, 3.5, dtype)
    prepare_transports(layout, transports, inputs, FLUX_DEV, dtype)  # outside every timed call
    return lambda: velocity(inputs.noise, 0.6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--world", type=int, default=1, help="2: the layouts x transports on two ranks")
    parser.add_argument("--share-gpu", action="store_true", help="with --world 2: both ranks on GPU 0")
    parser.add_argument("--steps", type=int, default=4, help="steps per edit for the DiT time column")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=list(MULTI_LAYOUTS),
        choices=MULTI_LAYOUTS,
        help="with --world 2: the layouts to compare",
    )
    parser.add_argument(
        "--head-groups",
        nargs="+",
        type=int,
        default=[1, 2],
        help="with --world 2: the head groups of each layout (24 heads / 2 ranks: 1, 2, 3, 4, 6, 12)",
    )
    args = parser.parse_args()
    needed = 1 if args.world == 1 or args.share_gpu else args.world
    if torch.cuda.device_count() < needed:
        print(
            f"bench_layouts: needs {needed} CUDA/ROCm GPU(s), {torch.cuda.device_count()} visible; nothing to measure."
        )
        return 0
    if args.world > 1:
        return multi_gpu(args)

    model = random_model(FLUX_DEV, seed=0, dtype=torch.bfloat16, device="cuda")
    inputs = edit_inputs(args.width, args.height, args.text_len)
    steps = {row: step_function(model, inputs, *row) for row in ROWS}
    times: dict = {row: [] for row in ROWS}
    with torch.inference_mode():
        outputs = {row: fn().float() for row, fn in steps.items()}  # warm-up, and the outputs to compare
        for _ in range(args.repeats):
            for row, fn in steps.items():
                times[row].append(gpu_and_backlog_s(fn)[0])
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
        rows.append(
            {
                "layout": name,
                "head_groups": groups,
                "step_s": step_s,
                "overhead_pct": 100 * (step_s / base - 1),
                "max_rel_error_vs_single": error,
            }
        )
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "width": args.width,
        "height": args.height,
        "text_len": args.text_len,
        "repeats": args.repeats,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9,
        "rows": rows,
    }


def print_table(report: dict) -> None:
    n = (report["width"] // 16) * (report["height"] // 16)
    print(
        f"\nFLUX.1-dev geometry, random bf16 weights, {report['width']}x{report['height']} edit "
        f"({n} output + {n} reference tokens, {report['text_len']} text), one CFG step (both branches), "
        f"{report['device']}, torch {report['torch']}, median of {report['repeats']}"
    )
    print(f"{'layout':<10} {'head groups':>11} {'step s':>8} {'vs single':>10} {'rel. error':>11}")
    for row in report["rows"]:
        print(
            f"{row['layout']:<10} {row['head_groups']:>11} {row['step_s']:>8.4f} {row['overhead_pct']:>+9.1f}% "
            f"{row['max_rel_error_vs_single']:>11.1e}"
        )
    ulysses = next(r for r in report["rows"] if (r["layout"], r["head_groups"]) == ("ulysses", 1))
    print(f"ulysses (P=1, 1 head group) vs single: {ulysses['overhead_pct']:+.1f}%")


# -- two ranks: every layout x transport x head groups against single ---------------------------------

TRANSPORTS = ("collective", "copy_engine")
MULTI_LAYOUTS = ("ulysses", "cfg_batch", "cfg_split")
SINGLE_ROW = ("single", 1, "collective")


def multi_rows(layouts, head_groups, share_gpu: bool) -> list:
    """``single`` (the reference) and every layout x head groups x transport asked for, in timing order."""
    rows = [SINGLE_ROW] + [
        (name, groups, transport) for name in layouts for groups in head_groups for transport in TRANSPORTS
    ]
    return [row for row in rows if not share_gpu or row == SINGLE_ROW or row[2] == "copy_engine"]


def multi_gpu(args) -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(multi_gpu_rank, args=(args, port), nprocs=args.world, join=True)
    return 0


def multi_gpu_rank(rank: int, args, port: int) -> None:
    device = torch.device("cuda", 0 if args.share_gpu else rank)
    torch.cuda.set_device(device)
    backend = "gloo" if args.share_gpu else "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world,
        **({} if args.share_gpu else {"device_id": device}),
    )
    model = random_model(FLUX_DEV, seed=0, dtype=torch.bfloat16, device=device)
    inputs = edit_inputs(args.width, args.height, args.text_len)
    rows = multi_rows(args.layouts, args.head_groups, args.share_gpu)
    timers = {row: ExposedTransfer(device) for row in rows}
    steps = {row: step_function(model, inputs, row[0], row[1], args.world, row[2], timers[row]) for row in rows}
    times: dict = {row: [] for row in rows}
    backlog: dict = {row: [] for row in rows}
    exposed: dict = {row: [] for row in rows}
    with torch.inference_mode():
        outputs = {row: fn().float() for row, fn in steps.items()}
        for _ in range(args.repeats):
            for row, fn in steps.items():
                timers[row].take()
                gpu_s, backlog_s = gpu_and_backlog_s(fn)
                times[row].append(gpu_s)
                backlog[row].append(backlog_s)
                exposed[row].append(timers[row].take())
    report = summarise_multi(times, exposed, outputs, args, backlog)
    if rank == 0:
        print_multi(report)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_layouts_multi.json").write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def by_kind_pct(taken: list, step_s: float) -> dict:
    """Median exposed % of the step per exchange kind (``ExposedTransfer.take()`` of each step)."""
    kinds = sorted({kind for t in taken for kind in t["by_kind"]})
    return {kind: 100 * statistics.median(t["by_kind"].get(kind, 0.0) for t in taken) / step_s for kind in kinds}


def summarise_multi(times: dict, exposed: dict, outputs: dict, args, backlog: dict) -> dict:
    reference = outputs[SINGLE_ROW]
    rows = []
    for row in outputs:
        name, groups, transport = row
        step_s = statistics.median(times[row])
        error = ((outputs[row] - reference).abs().max() / reference.abs().max()).item()
        twin = outputs.get((name, groups, "collective"))
        rows.append(
            {
                "layout": name,
                "head_groups": groups,
                "transport": transport,
                "step_s": step_s,
                "backlog_ms": 1e3 * statistics.median(backlog[row]),
                "dit_s": args.steps * step_s,
                "exposed_pct": 100 * statistics.median(e["total_s"] for e in exposed[row]) / step_s,
                "exposed_pct_by_kind": by_kind_pct(exposed[row], step_s),
                "max_rel_error_vs_single": error,
                "bitwise_as_collective": None if twin is None else bool(torch.equal(outputs[row], twin)),
            }
        )
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "world": args.world,
        "share_gpu": args.share_gpu,
        "width": args.width,
        "height": args.height,
        "text_len": args.text_len,
        "repeats": args.repeats,
        "steps": args.steps,
        "rows": rows,
    }


def print_multi(report: dict) -> None:
    print(
        f"\nFLUX.1-dev geometry, random bf16 weights, {report['width']}x{report['height']} edit, "
        f"{report['world']} ranks on {report['device']}{' (one GPU shared)' if report['share_gpu'] else ''}, "
        f"torch {report['torch']}, median of {report['repeats']} CFG steps, DiT s = {report['steps']} steps"
    )
    print("backlog ms = GPU work left when the host had issued the step; about 0 means the GPU waited for the host")
    print(
        f"{'layout':<10} {'groups':>6} {'transport':<12} {'step s':>8} {'backlog ms':>10} {'DiT s':>7} {'exposed':>8} "
        f"{'rel. err':>9} {'= collective':>12}  exposed % by kind"
    )
    for r in report["rows"]:
        print(
            f"{r['layout']:<10} {r['head_groups']:>6} {r['transport']:<12} {r['step_s']:>8.4f} "
            f"{r['backlog_ms']:>10.2f} "
            f"{r['dit_s']:>7.3f} "
            f"{r['exposed_pct']:>7.1f}% {r['max_rel_error_vs_single']:>9.1e} "
            f"{({True: 'yes', False: 'no', None: '-'})[r['bitwise_as_collective']]:>12}  "
            + " ".join(f"{kind} {pct:.1f}" for kind, pct in r["exposed_pct_by_kind"].items())
        )
    find = {(r["layout"], r["head_groups"], r["transport"]): r for r in report["rows"]}
    copy, coll = find.get(("ulysses", 2, "copy_engine")), find.get(("ulysses", 2, "collective"))
    if copy is None:
        return
    if coll is None:
        print(f"ulysses, 2 head groups, copy_engine: exposed {copy['exposed_pct']:.1f}% (no NCCL row on a shared GPU)")
        return
    faster = 100 * (1 - copy["dit_s"] / coll["dit_s"])
    print(
        f"ulysses, 2 head groups, copy_engine: exposed {copy['exposed_pct']:.1f}%, DiT time {faster:+.1f}% below "
        "collective"
    )


if __name__ == "__main__":
    sys.exit(main())
