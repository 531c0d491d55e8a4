"""Every BF16 attention kernel this GPU offers at the model's shapes: is there one faster than PyTorch's choice?

    python benchmarks/bf16_attention.py                  # S = 20992 and 8704, 24 heads of 128, batch 1
    python benchmarks/bf16_attention.py --s 20992 --sustain 5

Rows: PyTorch SDPA with its cuDNN backend on [B, H, S, D] views of the model's [B, S, H, D] tensors (what
``sdpa_attention`` runs, the peer), the same on contiguous [B, H, S, D] copies, SDPA's flash backend, and, with
cuDNN's Python frontend installed (``pip install nvidia-cudnn-frontend``), every execution plan cuDNN's
heuristics (modes A, B and fallback) offer for the same BF16 SDPA graph, each timed on its own. Times: medians
of rounds in turns (every round runs each case once, starting one later), each round ``--calls`` back-to-back
calls after one untimed call. Error: max |out - SDPA (cuDNN)| / max |SDPA (cuDNN)|. Then the two fastest rows
and the PyTorch rows run back to back for ``--sustain`` seconds while ``nvidia-smi`` samples the SM clock and
board power: at the board's power limit a kernel is only faster if it takes less energy per call.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditrun.kernels.fp8_sdpa import _bhsd, cudnn_module  # noqa: E402
from ditrun.kernels.tune import interleaved_ms  # noqa: E402
from vs_diffusers import ClockSampler  # noqa: E402

HEADS, HEAD_DIM = 24, 128


def sdpa_cases(q, k, v) -> dict:
    def case(backend: SDPBackend, contiguous: bool = False):
        qq, kk, vv = (t.transpose(1, 2) for t in (q, k, v))
        if contiguous:
            qq, kk, vv = (t.contiguous() for t in (qq, kk, vv))

        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qq, kk, vv).transpose(1, 2)
        return fn

    return {"sdpa cudnn (model's views)": case(SDPBackend.CUDNN_ATTENTION),
            "sdpa cudnn (contiguous)": case(SDPBackend.CUDNN_ATTENTION, True),
            "sdpa flash": case(SDPBackend.FLASH_ATTENTION)}


def cudnn_plan_cases(q, k, v) -> dict:
    """One case per execution plan of cuDNN's BF16 SDPA graph on the [B, S, H, D] tensors (through strides)."""
    cudnn = cudnn_module()
    if cudnn is None:
        print("cuDNN's Python frontend is not installed: its execution plans are left out")
        return {}
    handle = cudnn.create_handle()
    bf16, fp32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    tq, tk, tv = (graph.tensor(name=name, **_bhsd(tuple(q.shape)), data_type=bf16) for name in "qkv")
    to, _ = graph.sdpa(name="bf16", q=tq, k=tk, v=tv, generate_stats=False, attn_scale=1 / math.sqrt(q.shape[-1]))
    layout = _bhsd(tuple(q.shape))
    to.set_output(True).set_dim(layout["dim"]).set_stride(layout["stride"]).set_data_type(bf16)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    cases = {}
    for index in range(graph.get_execution_plan_count()):
        try:
            graph.build_plan_at_index(index)
        except Exception as error:  # noqa: BLE001  (a plan cuDNN cannot build here)
            print(f"cuDNN plan {index} not built: {str(error)[:100]}")
            continue
        out = torch.empty_like(q)
        workspace = torch.empty(max(1, graph.get_workspace_size_plan_at_index(index)), dtype=torch.uint8,
                                device=q.device)

        def fn(index=index, out=out, workspace=workspace):
            cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
            graph.execute_plan_at_index({tq: q, tk: k, tv: v, to: out}, workspace, index, handle=handle)
            return out
        cases[f"cudnn plan {index}: {graph.get_plan_name_at_index(index)}"] = fn
    return cases


def sustained(fn, seconds: float, calls: int) -> tuple[float, dict]:
    torch.cuda.synchronize()
    with ClockSampler() as clocks:
        begin, done = time.perf_counter(), 0
        while time.perf_counter() - begin < seconds:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            done += calls
        ms = (time.perf_counter() - begin) * 1e3 / done
    return ms, clocks.result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--s", nargs="+", type=int, default=[20992, 8704], help="tokens")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--sustain", type=float, default=3.0, help="seconds per sustained row (0: none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bf16_attention: no CUDA/ROCm GPU visible; nothing to measure.")
        return 0
    print(f"bf16_attention: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    for tokens in args.s:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        q, k, v = (torch.randn(1, tokens, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16() for _ in "qkv")
        cases = {**sdpa_cases(q, k, v), **cudnn_plan_cases(q, k, v)}
        reference = next(iter(cases.values()))().float()
        errors = {}
        for name, fn in list(cases.items()):
            try:
                errors[name] = ((fn().float() - reference).abs().max() / reference.abs().max()).item()
            except RuntimeError as error:  # a backend that does not take this shape here
                print(f"{name}: {str(error)[:120]}")
                del cases[name]
        ms = interleaved_ms(cases, args.rounds, args.calls)
        flops = 4 * tokens * tokens * HEADS * HEAD_DIM
        print(f"\nS = {tokens}\n| kernel | ms | TFLOP/s | x SDPA | error |\n|---|---|---|---|---|")
        first = ms[next(iter(ms))]
        for name, t in ms.items():
            print(f"| {name} | {t:.3f} | {flops / t / 1e9:.0f} | {first / t:.3f}x | {errors[name]:.1e} |")
        if args.sustain > 0:
            fastest = sorted(ms, key=ms.get)[:2]
            for name in dict.fromkeys([*list(ms)[:2], *fastest]):
                t, clocks = sustained(cases[name], args.sustain, args.calls)
                watts = clocks.get("watts", float("nan"))
                print(f"sustained {name}: {t:.3f} ms, {clocks.get('sm_mhz', float('nan')):.0f} MHz, {watts:.0f} W, "
                      f"{watts * t:.0f} mJ per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
