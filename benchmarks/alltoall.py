"""``collective`` against ``copy_engine`` on 2 GPUs: each Flux exchange's time and bandwidth, what an
in-flight transfer costs the GEMM and the attention kernel running beside it, and a profile of
the copy engine's exchange (memcpys, not kernels).

    python benchmarks/alltoall.py --out results/alltoall              # one process per GPU (2)
    python benchmarks/alltoall.py --share-gpu --out results/alltoall  # 2 processes on GPU 0 (CUDA IPC)

With ``--share-gpu`` the process group is gloo (NCCL refuses two ranks on one GPU), so only
``copy_engine`` is measured (its code path through IPC handles), without the NCCL columns.

Messages are the Q/K/V and attention-output exchanges of FLUX.1-dev (24 heads of 128, bf16,
Ulysses P=2, 512 text tokens) at a 1 MP edit (1 MP output + 1 MP reference) and at a 4 MP
output with a 1 MP reference, with 1 and 2 head groups. Each row is the median of
``--repeats`` exchanges, both ranks released together (barrier), CUDA events on the compute
stream from ``start`` to the end of ``wait``. Bandwidth counts the bytes sent to the peer.

The interference table runs a bf16 8192^3 GEMM and a Flux-sized SDPA attention alone, then
beside a transfer of ~1.2 GB in flight on each transport (started with the kernel: a GPU sleep
holds both until the host has issued everything), and prints the ratio (the measured ratios
and their reading: docs/PERFORMANCE.md). Exits 0 with a message without 2 GPUs (or 1 GPU with
``--share-gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ditrun.config import TransportConfig
from ditrun.parallel.ulysses import attention_shapes, even_splits
from ditrun.timers import ExposedTransfer
from ditrun.transport.base import ExchangeShape
from ditrun.transport.registry import make_transport

TRANSPORTS = ("collective", "copy_engine")


def transports_for(share_gpu: bool) -> tuple[str, ...]:
    """NCCL needs one GPU per rank: two ranks sharing a GPU measure the copy engine alone."""
    return ("copy_engine",) if share_gpu else TRANSPORTS


HEADS, HEAD_DIM, TEXT = 24, 128, 512
# (label, output side in pixels, reference side in pixels)
EDITS = [("1 MP", 1024, 1024), ("4 MP out + 1 MP ref", 2048, 1024)]


def joint_tokens(out_side: int, ref_side: int) -> int:
    return (out_side // 16) ** 2 + (ref_side // 16) ** 2 + TEXT


def flux_shapes(world: int) -> list[tuple[str, int, ExchangeShape]]:
    """(edit label, head groups, shape) for every measured message."""
    rows = []
    for label, out_side, ref_side in EDITS:
        splits = even_splits(joint_tokens(out_side, ref_side), world)
        for groups in (1, 2):
            for shape in attention_shapes(splits, 1, HEADS, HEAD_DIM, groups, torch.bfloat16):
                rows.append((label, groups, shape))
    return rows


IN_FLIGHT_EXCHANGES = 24
"""Exchanges of ~50 MB per peer kept in flight beside a kernel: ~1.2 GB, longer than either kernel on
either transport (the table shows by how much the transfer outlasted the kernel)."""
HOLD_CYCLES = 50_000_000
"""A GPU sleep (~25 ms) queued before the transfers, so that the host has issued them all by the time
it ends: transfer and kernel then start together on both transports."""


def hold_gpu(cycles: int) -> None:
    """Keep the compute stream busy while the host issues what follows (it then all starts at once)."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(cycles)


def stream_shape(world: int) -> ExchangeShape:
    """A transfer kept in flight beside a kernel: independent exchanges of ~50 MB to each peer."""
    rows = 65536
    return ExchangeShape(
        "in_flight",
        tuple((rows,) * world for _ in range(world)),
        (3, 1, 1, 128),
        torch.bfloat16,
        head_groups=IN_FLIGHT_EXCHANGES,
    )


def peer_bytes(shape: ExchangeShape, rank: int) -> int:
    return sum(n for j, n in enumerate(shape.send_splits(rank)) if j != rank) * shape.row_bytes


def time_exchange(transport, shape: ExchangeShape, head_group: int, repeats: int, hide_host: bool = False) -> float:
    """Median seconds from start to the end of wait on the compute stream; ``hide_host``: a GPU sleep
    before the start event covers the host's issuing, so only the GPU's part is timed."""
    samples = []
    for i in range(repeats + 2):
        send = transport.send_buffer(shape, head_group)
        torch.cuda.synchronize()
        dist.barrier()
        if hide_host:
            hold_gpu(HOLD_CYCLES // 5)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        handle = transport.start(send, shape, head_group)
        handle.wait()
        end.record()
        handle.release()
        end.synchronize()
        if i >= 2:  # two warm-ups: the first use of each slot
            samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def host_issue_s(transport, shape: ExchangeShape, head_group: int, repeats: int) -> float:
    """Median host seconds to issue one exchange (send_buffer, start, wait, release), GPU idle before.

    Nothing in between synchronises, so this is what the host adds per exchange; a layout whose
    compute between exchanges is shorter than it leaves the GPU waiting for the host.
    """
    samples = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        dist.barrier()
        began = time.perf_counter()
        send = transport.send_buffer(shape, head_group)
        handle = transport.start(send, shape, head_group)
        handle.wait()
        handle.release()
        if i >= 2:
            samples.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    return statistics.median(samples)


def kernels(device) -> dict:
    """The kernels whose slowdown is measured, each a closure on fixed inputs."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    tokens = joint_tokens(1024, 1024)
    q, k, v = (torch.randn(1, HEADS // 2, tokens, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(3))
    return {
        "GEMM bf16 8192^3": lambda: a @ b,
        f"SDPA {HEADS // 2} heads x {tokens} tokens": lambda: F.scaled_dot_product_attention(q, k, v),
    }


def time_kernel(kernel, transport=None, shape=None, repeats: int = 10) -> tuple[float, float]:
    """Median kernel seconds, alone or with ``shape``'s exchanges in flight on ``transport``, and the
    least time by which the transfer outlasted the kernel (> 0: it was in flight the whole time)."""
    samples, outlasted = [], []
    for _ in range(repeats + 1):
        sends = [] if transport is None else [transport.send_buffer(shape, g) for g in range(shape.head_groups)]
        torch.cuda.synchronize()
        dist.barrier()
        hold_gpu(HOLD_CYCLES)
        handles = [] if transport is None else [transport.start(s, shape, g) for g, s in enumerate(sends)]
        start, end, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        kernel()
        end.record()
        for handle in handles:
            handle.wait()
            handle.release()
        done.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
        outlasted.append(end.elapsed_time(done) / 1e3)
    return statistics.median(samples[1:]), min(outlasted[1:])


def profile_exchange(transport, shape: ExchangeShape, out: Path, name: str) -> dict:
    """What one exchange runs on the GPU: memcpys and kernels by name (a trace is saved)."""
    from torch.profiler import ProfilerActivity, profile

    send = transport.send_buffer(shape)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        handle = transport.start(send, shape)
        handle.wait()
        handle.release()
        torch.cuda.synchronize()
    trace = out / f"profile_{name}_rank{dist.get_rank()}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    by_cat: dict = {}
    for event in events:
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_cat.setdefault(event["cat"], []).append(event["name"])
    return {cat: sorted(set(names)) for cat, names in by_cat.items()} | {
        f"{cat}_count": len(names) for cat, names in by_cat.items()
    }


def rank_main(rank: int, world: int, args, port: int) -> None:
    device = torch.device("cuda", 0 if args.share_gpu else rank)
    torch.cuda.set_device(device)
    init_ranks(rank, world, port, device, args.share_gpu)
    timer = ExposedTransfer(device)
    transports = {
        name: make_transport(TransportConfig(name=name), dist.group.WORLD, timer, device, 120.0)
        for name in transports_for(args.share_gpu)
    }
    shapes = flux_shapes(world)
    bulk = stream_shape(world)
    for transport in transports.values():
        transport.prepare([shape for _, _, shape in shapes] + [bulk])
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "world": world,
        "share_gpu": args.share_gpu,
        "exchanges": [],
        "slowdown": [],
        "profile": {},
    }
    for label, groups, shape in shapes:
        row = {"edit": label, "kind": shape.kind, "head_groups": groups, "peer_mb": peer_bytes(shape, rank) / 1e6}
        for name, transport in transports.items():
            row[f"{name}_ms"] = 1e3 * time_exchange(transport, shape, 0, args.repeats)
            row[f"{name}_gpu_ms"] = 1e3 * time_exchange(transport, shape, 0, args.repeats, hide_host=True)
            row[f"{name}_host_us"] = 1e6 * host_issue_s(transport, shape, 0, args.repeats)
        report["exchanges"].append(row)
    for label, kernel in kernels(device).items():
        row = {"kernel": label, "alone_ms": 1e3 * time_kernel(kernel)[0]}
        for name, transport in transports.items():
            kernel_s, outlasted_s = time_kernel(kernel, transport, bulk)
            row[f"{name}_ms"], row[f"{name}_outlasted_ms"] = 1e3 * kernel_s, 1e3 * outlasted_s
        report["slowdown"].append(row)
    small = shapes[0][2]
    for name, transport in transports.items():
        report["profile"][name] = profile_exchange(transport, small, args.out, name)
    if rank == 0:
        print_tables(report)
        (args.out / "alltoall.json").write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def init_ranks(rank: int, world: int, port: int, device: torch.device, share_gpu: bool) -> None:
    backend = "gloo" if share_gpu else "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        **({} if share_gpu else {"device_id": device}),
    )


def _ms(row: dict, transport: str, suffix: str = "_ms") -> str:
    return f"{row[transport + suffix]:.3f}" if transport + suffix in row else "-"


def _us(row: dict, transport: str) -> str:
    return f"{row[transport + '_host_us']:.0f}" if transport + "_host_us" in row else "-"


def print_tables(report: dict) -> None:
    print(
        f"\nall-to-all over {report['world']} ranks on {report['device']}"
        f"{' (one GPU shared, CUDA IPC)' if report['share_gpu'] else ''}, torch {report['torch']}"
    )
    print(
        f"{'edit':<20} {'exchange':<14} {'groups':>6} {'to peer MB':>10} {'collective ms':>14} {'GB/s':>7} "
        f"{'copy_engine ms':>15} {'GB/s':>7} {'speedup':>8} {'GPU ms: collective':>19} {'copy_engine':>12} "
        f"{'host us: collective':>20} {'copy_engine':>12}"
    )
    for r in report["exchanges"]:
        gbps = {t: f"{r['peer_mb'] / r[t + '_ms']:.0f}" if t + "_ms" in r else "-" for t in TRANSPORTS}
        speedup = f"{r['collective_ms'] / r['copy_engine_ms']:.2f}x" if "collective_ms" in r else "-"
        print(
            f"{r['edit']:<20} {r['kind']:<14} {r['head_groups']:>6} {r['peer_mb']:>10.1f} "
            f"{_ms(r, 'collective'):>14} {gbps['collective']:>7} {_ms(r, 'copy_engine'):>15} "
            f"{gbps['copy_engine']:>7} {speedup:>8} {_ms(r, 'collective', '_gpu_ms'):>19} "
            f"{_ms(r, 'copy_engine', '_gpu_ms'):>12} {_us(r, 'collective'):>20} {_us(r, 'copy_engine'):>12}"
        )
    print(
        "(ms: CUDA events on the compute stream from before start to after wait, host issue included; GPU ms: "
        "the same with the host's issuing hidden behind a GPU sleep; host us: host time to issue send_buffer + "
        "start + wait + release)"
    )
    print(
        f"\n{'kernel':<28} {'alone ms':>9} {'beside collective':>18} {'beside copy_engine':>19}   "
        f"(kernel time beside an in-flight transfer / alone)"
    )
    for r in report["slowdown"]:
        ratio = {t: r[f"{t}_ms"] / r["alone_ms"] for t in TRANSPORTS if f"{t}_ms" in r}
        shown = {t: f"{ratio[t]:.3f}x" if t in ratio else "-" for t in TRANSPORTS}
        outlasted = " ".join(f"{t} {r[t + '_outlasted_ms']:+.2f}" for t in TRANSPORTS if t + "_outlasted_ms" in r)
        print(
            f"{r['kernel']:<28} {r['alone_ms']:>9.3f} {shown['collective']:>18} {shown['copy_engine']:>19}"
            f"   transfer outlasted kernel by ms: {outlasted}"
        )
    print("(a negative 'outlasted' means the transfer ended before the kernel: the ratio then understates it)")
    print("\nprofile of one 1 MP qkv exchange (rank 0):")
    for name, found in report["profile"].items():
        print(
            f"  {name}: {found.get('gpu_memcpy_count', 0)} memcpy, {found.get('kernel_count', 0)} kernels "
            f"{found.get('kernel', [])}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--share-gpu", action="store_true", help="run both ranks on GPU 0 (CUDA IPC between them)")
    parser.add_argument("--out", type=Path, default=Path("results/alltoall"))
    args = parser.parse_args()
    needed = 1 if args.share_gpu else 2
    if torch.cuda.device_count() < needed:
        print(f"alltoall: needs {needed} GPU(s), {torch.cuda.device_count()} visible; nothing to measure.")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    mp.spawn(rank_main, args=(2, args, free_port()), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
