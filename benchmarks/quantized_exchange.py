"""The quantized exchange end to end: one CFG step of ``ulysses`` over two ranks with a quantized attention format,
Q/K/V exchanged as values (BF16, quantized by the attention kernel after the exchange) against as codes (the fused
producer writes Q's and K's INT8 codes from the projections into the send slot; ``precision.quantized_exchange``).

    python benchmarks/quantized_exchange.py --share-gpu      # both ranks on GPU 0 (gloo, copy engine over CUDA IPC)
    python benchmarks/quantized_exchange.py                  # one rank per GPU (NCCL)
    python benchmarks/quantized_exchange.py --share-gpu --compile --attention int8qk_mxfp6v

FLUX.1-dev geometry, random BF16 weights (numerical drift only, not quality), a Kontext edit of ``--width`` x
``--height`` (as many reference tokens as output tokens). Each row: the step's GPU time (median of ``--repeats``,
the modes in alternation), the qkv exchange's bytes a rank sent per step (counted by the transport), and the
relative error of the guided velocity against one process running the same attention kernel. With
``--share-gpu`` the two ranks' kernels share one GPU, so a step takes about two ranks' compute: the difference
between the rows is what the producer and the exchange cost, not a two-GPU speed-up.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import LayoutArgs, edit_inputs, gpu_and_backlog_s, print_table, relative_error

from ditrun.config import TransportConfig
from ditrun.kernels.attention import ATTENTION_KERNELS, choose_implementation
from ditrun.kernels.attention_payload import payload_for
from ditrun.model.load import random_model
from ditrun.model.presets import PRESETS
from ditrun.model.sampler import PlainForward
from ditrun.parallel.cfg import layout_velocity, prepare_transports
from ditrun.parallel.layout import plan_layout
from ditrun.parallel.placement import Placement, build_layout
from ditrun.timers import ExposedTransfer
from ditrun.transport.registry import make_transport

FLUX_DEV = PRESETS["flux-dev"]


def rank_main(rank: int, args, port: int) -> None:
    device = torch.device("cuda", 0 if args.share_gpu else rank)
    torch.cuda.set_device(device)
    backend = "gloo" if args.share_gpu else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = random_model(FLUX_DEV, seed=0, dtype=torch.bfloat16, device=device)
    if args.compile:
        from ditrun.model.compile import compile_regions

        compile_regions(model)
    inputs = edit_inputs(args.width, args.height, args.text_len, device)
    kernel = ATTENTION_KERNELS.get(args.attention)
    implementation = choose_implementation(kernel, device, FLUX_DEV.attention_head_dim, fast=True)
    inner = kernel.make(implementation)
    transport = "copy_engine" if args.share_gpu else args.transport
    steps, counters = {}, {}
    for mode in ("one process", "values", "codes"):
        name = "single" if mode == "one process" else "ulysses"
        groups = 1 if name == "single" else args.head_groups  # one process has nothing to overlap
        plan = plan_layout(LayoutArgs(name, groups), 1 if name == "single" else 2, 24)
        layout = build_layout(Placement.on_one_node(plan))
        timer = ExposedTransfer(device)
        transports = {
            axis: make_transport(TransportConfig(name=transport), layout.groups[axis], timer, device, 120.0)
            for axis in ("sp", "cfg")
        }
        payload = payload_for(args.attention, implementation) if mode == "codes" else None
        velocity = layout_velocity(
            layout, transports, PlainForward(model), inputs, 2.5, 3.5, torch.bfloat16, inner, payload
        )
        prepare_transports(layout, transports, inputs, FLUX_DEV, torch.bfloat16, payload)
        steps[mode] = lambda velocity=velocity: velocity(inputs.noise, 0.6)
        counters[mode] = transports["sp"].sent
    times: dict = {mode: [] for mode in steps}
    sent: dict = {}
    with torch.inference_mode():
        outputs = {mode: fn().float() for mode, fn in steps.items()}  # warm-up (and compilation)
        for _ in range(args.repeats):
            for mode, fn in steps.items():
                counters[mode].take()
                times[mode].append(gpu_and_backlog_s(fn)[0])
                sent[mode] = counters[mode].take()
    if rank == 0:
        reference = outputs["one process"]
        rows = [
            {
                "exchange": mode,
                "step ms": f"{1e3 * statistics.median(times[mode]):.1f}",
                "qkv MB sent": f"{sent[mode].get('qkv', 0) / 1e6:.1f}",
                "all MB sent": f"{sum(sent[mode].values()) / 1e6:.1f}",
                "rel. error vs one process": f"{relative_error(outputs[mode], reference):.2e}",
            }
            for mode in steps
        ]
        n = (args.width // 16) * (args.height // 16)
        print(
            f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}: {args.attention} ({implementation}), "
            f"ulysses over 2 ranks{' sharing one GPU' if args.share_gpu else ''}, {args.head_groups} head groups, "
            f"{transport}, {'compiled' if args.compile else 'eager'}; {n} output + {n} reference + "
            f"{args.text_len} text tokens, one CFG step, median of {args.repeats}"
        )
        print_table(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attention", default="int8qk_fp8v", choices=["int8qk", "int8qk_fp8v", "int8qk_mxfp6v"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--head-groups", type=int, default=2)
    parser.add_argument("--transport", default="copy_engine", choices=["collective", "copy_engine"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--share-gpu", action="store_true", help="both ranks on GPU 0")
    parser.add_argument("--compile", action="store_true", help="the blocks' halves compiled, as a run does")
    args = parser.parse_args()
    needed = 1 if args.share_gpu else 2
    if torch.cuda.device_count() < needed:
        print(f"quantized_exchange: needs {needed} GPU(s), {torch.cuda.device_count()} visible; nothing to measure.")
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args, port), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
