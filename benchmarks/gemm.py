"""Quantized linear GEMMs on the Flux shapes, against BF16 on the same GPU (one H200, or an MI355X).

    python benchmarks/gemm.py                # M = 4608 and 20992, every Flux (K, N)
    python benchmarks/gemm.py --m 4608 --repeats 30
    python benchmarks/gemm.py --tilings                      # the Triton activation quantizers' tilings, per K
    python benchmarks/gemm.py --joined --m 20992             # a down projection's input: GELU (+ prefix) + FP8

For each (M, K, N) it times, with CUDA events (median of ``--repeats``, each ``--calls`` back-to-back
calls replayed as one CUDA graph, as a graphed model runs them, every column of a row in turns so
that clock drift weighs on all alike; ``--timing calls``: launched one by one, back to back, host
included; ``--timing single``: one call at a time; both column by column):
``bf16`` (torch.nn.functional.linear), ``fp8 gemm`` (torch._scaled_mm on operands quantized
beforehand: the ceiling of any FP8 path), and each quantized backend end to end as a model
call runs it: activation quantization (one Triton kernel) + GEMM. Speedups are against bf16; the
MX repack column is also given as a fraction of the fp8 path (the aim: within 10%).
``fp8 quant ms`` / ``mxfp6 quant ms``: the activation quantizer alone, with the bandwidth of one
pass (bf16 read + fp8 write = 3 bytes per element; the H200 peaks near 4.8 TB/s).
Every backend's output is compared with the emulation reference (relative error, max-norm).
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.nn.functional as F
from harness import CUDA, print_table, relative_error, time_ms

from ditrun.kernels import linear as L

# Flux (FLUX.1-dev) linears: (name, K, N). Q/K/V(+gate) are one stacked GEMM; the single-stream
# block's proj_out takes [attention, MLP] = 3072 + 12288 channels.
FLUX_SHAPES = [
    ("qkv (stacked)", 3072, 9216),
    ("attn out", 3072, 3072),
    ("mlp up / single proj_mlp", 3072, 12288),
    ("mlp down", 12288, 3072),
    ("single proj_out", 15360, 3072),
]
M_VALUES = (4608, 20992)
"""Tokens of one forward: a 1024x1024 image (4096 latent tokens) + 512 text tokens = 4608, and the
published benchmark's edit, a 4 MP output + 1 MP reference + 512 text = 16384 + 4096 + 512 = 20992."""


def timer(mode: str, calls: int):
    """fn, repeats -> median ms per call, timed as ``--timing`` says."""
    if mode == "graph":
        return lambda fn, repeats: harness.graph_ms(fn, repeats, calls)
    return lambda fn, repeats: time_ms(fn, CUDA, repeats, calls if mode == "calls" else 1)


def timings(mode: str, calls: int):
    """{name: fn}, repeats -> {name: median ms per call}: with graphs, the cases of one row in turns
    (``harness.interleaved_graph_ms``); otherwise one after another."""
    if mode == "graph":
        return lambda fns, repeats: harness.interleaved_graph_ms(fns, repeats, calls)
    single = timer(mode, calls)
    return lambda fns, repeats: {name: single(fn, repeats) for name, fn in fns.items()}


def bench_shape(m: int, k: int, n: int, repeats: int, formats: list[str], measure) -> dict[str, str]:
    """One row of the table; ``measure({name: fn}, repeats)`` times its cases (``timings``)."""
    device = CUDA
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(torch.bfloat16)
    cases, notes = {"bf16": lambda: F.linear(x, w)}, {}
    if L._has_rowwise_fp8(device):
        dtype = L.fp8_dtype()
        x8, xs = L.quantize_rowwise_fp8(x, dtype)
        w8, ws = L.quantize_rowwise_fp8(w, dtype)
        cases["fp8 gemm"] = lambda: L._scaled_mm(x8, w8, xs, ws, torch.bfloat16)
        cases["fp8 fast-accum gemm"] = lambda: L._scaled_mm(x8, w8, xs, ws, torch.bfloat16, fast_accum=True)
    for name in formats:
        fmt = L.LINEAR_FORMATS.get(name.removesuffix("_fast"), "--formats")
        backends = L.fast_backends(fmt, device)
        if name.endswith("_fast"):
            backends = [b for b in backends if b.endswith("_fast")]
        if not backends:
            notes[name] = "no fast backend"
            continue
        layer = L.QuantizedLinear.with_backend(w, fmt, backends[0])  # the model's path: quantizer + GEMM
        cases[name] = lambda layer=layer: layer(x)
        if name in ("fp8", "mxfp6"):  # the activation quantizer alone: one pass over x, or not?
            backend = layer.backends[backends[0]]  # the quantizer the layer's eager GPU call runs
            quantize = getattr(backend, "quantize_counted", backend.quantize)
            cases[f"{name} quant"] = lambda quantize=quantize, fmt=fmt: quantize(x, fmt, "rceil")
        error = relative_error(layer(x), L.QuantizedLinear.with_backend(w, fmt, "emulation")(x))
        notes[name] = f"{backends[0]}; err {error:.1e}"
    ms = measure(cases, repeats)
    bf16, flops = ms["bf16"], 2 * m * k * n
    row = {"bf16 ms": f"{bf16:.3f} ({flops / bf16 / 1e9:.0f} TF/s)"}
    for name in ("fp8 gemm", "fp8 fast-accum gemm"):
        if name in ms:
            row[f"{name} ms"] = f"{ms[name]:.3f} ({bf16 / ms[name]:.2f}x)"
    for name in formats:
        if name not in ms:
            row[name] = notes[name]
            continue
        if f"{name} quant" in ms:
            quant = ms[f"{name} quant"]
            row[f"{name} quant ms"] = f"{quant:.3f} ({3 * x.numel() / quant / 1e9:.2f} TB/s)"
        versus_fp8 = f", {ms[name] / ms['fp8']:.2f} of fp8" if "fp8" in ms and name != "fp8" else ""
        row[name] = f"{ms[name]:.3f} ({bf16 / ms[name]:.2f}x{versus_fp8}; {notes[name]})"
    return row


def tiling_rows(m: int, repeats: int, time_ms) -> list[dict[str, str]]:
    """The Triton activation quantizers (row-wise FP8, MXFP6 repack) of an [m, K] BF16 activation for each K of the
    Flux linears, in every candidate tiling (``quantize_triton.candidate_tilings``), the default marked, the fastest
    starred."""
    from ditrun.kernels import formats
    from ditrun.kernels import quantize_triton as T

    dtype, element = L.fp8_dtype(), "fp6_e2m3"
    headroom = L.repack_headroom(formats.FORMATS[element])
    rows = []
    for k in sorted({k for _, k, _ in FLUX_SHAPES}):
        x = torch.randn(m, k, device=CUDA, generator=torch.Generator(device=CUDA).manual_seed(k)).to(torch.bfloat16)
        io_bytes = 3 * x.numel()
        defaults = {kernel: T.default_tiling(k, kernel) for kernel in ("fp8", "mx")}
        cases = {
            str(t) + "".join(f" (default {kernel})" for kernel, d in defaults.items() if t == d): (
                lambda t=t: T.rowwise_fp8(x, dtype, tiling=t),
                lambda t=t: T.mx_repack_fp8(x, element, 32, "rceil", headroom, tiling=t),
            )
            for t in T.candidate_tilings(k) + list(defaults.values())
        }
        times = {name: [time_ms(fn, repeats) for fn in fns] for name, fns in cases.items()}
        best = [min(ms[i] for ms in times.values()) for i in range(2)]
        for name, ms in times.items():
            rows.append(
                {
                    "M": str(m),
                    "K": str(k),
                    "tiling": name,
                    **{
                        f"{kind} ms": f"{ms[i]:.4f} ({io_bytes / ms[i] / 1e9:.2f} TB/s)"
                        + (" *" if ms[i] == best[i] else "")
                        for i, kind in enumerate(("fp8", "mxfp6 repack"))
                    },
                }
            )
    return rows


def joined_rows(m: int, repeats: int, time_ms) -> list[dict[str, str]]:
    """A down projection's FP8 input from the MLP's hidden state [m, 12288]: GELU, with the single block's attention
    output [m, 3072] before it or without, each row's amax and codes. ditrun's kernel (``precision.quantizer=kernel``)
    in its default tiling and others, against the same function compiled by Inductor (``quantizer=compiled``'s way,
    fused into one kernel where Inductor can) on the same inputs; rates at the bytes one pass must move (bf16 in,
    E4M3 and the scales out)."""
    from ditrun.kernels import quantize_triton as T
    from ditrun.model.dit import gelu_activation

    dtype = L.fp8_dtype()
    g = torch.Generator(device=CUDA).manual_seed(5)
    hidden = torch.randn(m, 12288, device=CUDA, generator=g).to(torch.bfloat16)
    attention = torch.randn(m, 3072, device=CUDA, generator=g).to(torch.bfloat16)

    def composed(h, prefix):
        a = gelu_activation(h)
        return L.quantize_rowwise_fp8(a if prefix is None else torch.cat([prefix, a], dim=1), dtype)

    compiled = torch.compile(composed, dynamic=False)
    rows = []
    for prefix in (None, attention):
        moved = 3 * hidden.numel() + (0 if prefix is None else 3 * prefix.numel()) + 4 * m
        default = T.joined_tiling(hidden.shape[1])
        cases = {"inductor (compiled torch)": lambda p=prefix: compiled(hidden, p)}
        for t in [default, T.Tiling(2, 16384, 16, True), T.Tiling(1, 16384, 32, True), T.Tiling(1, 1024, 8),
                  T.Tiling(1, 2048, 8), T.Tiling(1, 1024, 4)]:  # fmt: skip
            name = f"kernel, {t}" + (" (default)" if t == default else "")
            cases[name] = lambda t=t, p=prefix: T.rowwise_fp8(hidden, dtype, tiling=t, activation="gelu_tanh", prefix=p)
        for name, fn in cases.items():
            ms = time_ms(fn, repeats)
            rows.append(
                {
                    "M": str(m),
                    "rows": "[attention 3072 | GELU(12288)]" if prefix is not None else "GELU(12288)",
                    "quantizer": name,
                    "ms": f"{ms:.4f}",
                    "TB/s": f"{moved / ms / 1e9:.2f}",
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--formats",
        nargs="*",
        default=["fp8", "fp8_fast", "mxfp8", "mxfp6", "mxfp4"],
        help="linear formats; NAME_fast: that format on its fast-accumulation backend where one exists",
    )
    parser.add_argument(
        "--tilings",
        action="store_true",
        help="only the Triton activation quantizers, every candidate tiling, per K of the Flux linears",
    )
    parser.add_argument(
        "--joined",
        action="store_true",
        help="only a down projection's input quantizer (GELU + FP8, with the attention output or without): "
        "ditrun's kernel in several tilings against Inductor's",
    )
    parser.add_argument(
        "--timing",
        choices=("graph", "calls", "single"),
        default="graph",
        help="graph: --calls calls replayed as one CUDA graph (the GPU's time); calls: launched back "
        "to back (host included); single: one call at a time",
    )
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gemm.py needs a CUDA/ROCm GPU")
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"{'ROCm ' + torch.version.hip if torch.version.hip else 'CUDA ' + str(torch.version.cuda)}"
    )
    print(f"timing: {args.timing}" + (f", {args.calls} calls" if args.timing != "single" else ""))
    timed = timer(args.timing, args.calls)
    if args.tilings:
        print_table([row for m in args.m for row in tiling_rows(m, args.repeats, timed)])
        return
    if args.joined:
        print_table([row for m in args.m for row in joined_rows(m, args.repeats, timed)])
        return
    rows = []
    for m in args.m:
        for name, k, n in FLUX_SHAPES:
            rows.append(
                {
                    "M": str(m),
                    "linear": name,
                    "K": str(k),
                    "N": str(n),
                    **bench_shape(m, k, n, args.repeats, args.formats, timings(args.timing, args.calls)),
                }
            )
    print_table(rows)


if __name__ == "__main__":
    main()
