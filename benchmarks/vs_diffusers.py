"""ditrun's DiT against diffusers' fastest Flux recipes, side by side, on one GPU, same weights.

One process, one random FLUX.1-dev-geometry checkpoint (diffusers' own random init, bf16, on
the GPU). Every ditrun model is built from diffusers' tensors in memory (``build_model(...,
weights=...)``: assigned, not copied), so both sides compute with the same numbers. Per mode and
per shape: CUDA-event median of one forward after warm-up, TFLOP/s against the GEMM ceilings
measured first, the output's relative error against diffusers eager BF16 (the reference: every
row prints its error beside its time, so no faster-but-wrong mode passes unseen), ratios against
every diffusers row, and a kernel-time breakdown (attention / GEMM / rest) from the profiler.

Modes (``--modes``; default all, in this order, because diffusers' rows change its model in place):

* ``diffusers``            eager BF16 (the reference output)
* ``ditrun``               eager BF16, what ``model.compile=off`` runs
* ``ditrun-compiled``      BF16, fused projections + compile (``model.compile=auto`` on GPUs); layout
                           ``single``, so each block is one graph with its attention inside
* ``ditrun-compiled-no-epilogues`` the same without the GELU MLPs in their GEMMs' epilogues
                           (``compile.GELU_EPILOGUES`` off: the code before 2026-12-01, for comparison)
* ``ditrun-compiled-regions`` the same with the attention between the compiled halves, as a layout
                           that exchanges runs it (``ulysses``, ``cfg_*``): what leaving it out costs
* ``ditrun-fp8``           ``precision=fp8`` compiled
* ``ditrun-fp8-fast``      the same on ``precision.backend=fp8_rowwise_fast`` (fast FP8 accumulation,
                           as torchao's inference default)
* ``ditrun-fp8-int8qk``    FP8 linears + INT8-QK attention (BF16 V), compiled
* ``ditrun-krea``          ``precision=krea`` (MXFP6 MLPs on the FP8 repack, FP8 projections, INT8-QK
                           attention with MXFP6 V), compiled
* ``ditrun-fp8-fast-int8qk`` FP8 linears with fast accumulation + INT8-QK attention, compiled
* ``ditrun-fp8-fast-fp8attn`` FP8 linears with fast accumulation + FP8 attention (FP8 Q.K^T), compiled
* ``ditrun-fp8-fast-fp8pv`` FP8 linears with fast accumulation + ``fp8_pv`` attention (cuDNN's fused FP8
                           kernel: Q, K, V and P in E4M3), compiled
* ``ditrun-fp8-fast-int8qkfp8v`` FP8 linears with fast accumulation + ``int8qk_fp8v`` attention (the Hopper
                           Gluon kernel: INT8 Q.K^T, FP8 P @ V), compiled
* ``diffusers-compiled``   ``compile_repeated_blocks(fullgraph=True)``
* ``diffusers-torchao-fp8`` torchao ``Float8DynamicActivationFloat8WeightConfig(PerRow())`` + the same compile

Shapes (``--tokens``; image + reference + text tokens): 8704 (Kontext 1 MP edit: 4096 out +
4096 ref + 512 text), 20992 (4 MP out + 1 MP ref + 512 text), 4608 (1 MP generation).

    python benchmarks/vs_diffusers.py --out results/vs                # everything (~15 min on an H200)
    python benchmarks/vs_diffusers.py --modes diffusers ditrun-krea --tokens 20992

Options: ``--compile-tuning`` compiles ditrun's modes with ``model.compile_tuning`` (inductor's coordinate-descent
tuning; diffusers' rows keep their recipe); ``--fused-quantizer`` quantizes the FP8 down projections' inputs with
``ditrun::act_rowwise_fp8`` instead of inductor's fusion (off by default: it measured slower); ``--cuda-graphs``
replays ditrun's compiled forwards from CUDA graphs (``model.cuda_graphs``); ``--tanh-gelu`` keeps GELU's tanh
form in compiled regions (``dit.GELU_AS_SIGMOID`` off: the code before 2026-11-30, for comparison);
``--triton-int8qk`` runs INT8-QK attention on the Triton kernel on Hopper too (``attention.GLUON_INT8QK`` off).

Needs a GPU with ~90 GB free, diffusers (and torchao for its row); exits 0 with a message otherwise.
Compile time per mode is the first call's wall time minus a steady call (printed apart).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditrun.config import ModelConfig, PrecisionConfig  # noqa: E402
from ditrun.kernels import attention as A  # noqa: E402
from ditrun.kernels import linear as L  # noqa: E402
from ditrun.model.build import PRESET_DIR, Placement, build_model, plan_precision  # noqa: E402
from ditrun.model import dit  # noqa: E402
from ditrun.model import compile as compile_module  # noqa: E402
from ditrun.model.compile import CompilePlan  # noqa: E402
from ditrun.model.latents import token_ids  # noqa: E402
from ditrun.model.presets import PRESETS  # noqa: E402
from bench_flux_step import cuda_time, forward_flops, nothing_to_measure  # noqa: E402  (the same timing and FLOP count)

FLUX_DEV = PRESETS["flux-dev"]
TEXT = 512
SHAPES = {  # total tokens -> (output side px, reference side px or 0): 1 MP = 1024 x 1024
    8704: (1024, 1024),
    20992: (2048, 1024),
    4608: (1024, 0),
}
PRECISIONS = {  # ditrun mode -> precision map (``conf/precision/*.yaml`` names and values)
    "ditrun": "bf16", "ditrun-compiled": "bf16", "ditrun-compiled-no-epilogues": "bf16", "ditrun-fp8": "fp8",
    "ditrun-fp8-fast": dict(name="fp8", mlp="fp8", qkv="fp8", out="fp8", backend="fp8_rowwise_fast"),
    "ditrun-fp8-int8qk": dict(name="fp8-int8qk", mlp="fp8", qkv="fp8", out="fp8", attention="int8qk"),
    "ditrun-krea": dict(name="krea", mlp="mxfp6", qkv="fp8", out="fp8", attention="int8qk_mxfp6v"),
    "ditrun-fp8-fast-int8qk": dict(name="fp8-int8qk", mlp="fp8", qkv="fp8", out="fp8", attention="int8qk",
                                   backend="fp8_rowwise_fast"),
    "ditrun-fp8-fast-fp8attn": dict(name="fp8-fp8attn", mlp="fp8", qkv="fp8", out="fp8", attention="fp8",
                                    backend="fp8_rowwise_fast"),
    "ditrun-fp8-fast-fp8pv": dict(name="fp8-fp8pv", mlp="fp8", qkv="fp8", out="fp8", attention="fp8_pv",
                                  backend="fp8_rowwise_fast"),
    "ditrun-fp8-fast-int8qkfp8v": dict(name="fp8-int8qkfp8v", mlp="fp8", qkv="fp8", out="fp8",
                                       attention="int8qk_fp8v", backend="fp8_rowwise_fast"),
}
MODES = ("diffusers", "ditrun", "ditrun-compiled", "ditrun-compiled-no-epilogues", "ditrun-compiled-regions",
         "ditrun-fp8", "ditrun-fp8-fast", "ditrun-fp8-fast-regions", "ditrun-fp8-int8qk", "ditrun-krea",
         "ditrun-fp8-fast-int8qk", "ditrun-fp8-fast-fp8attn", "ditrun-fp8-fast-fp8pv", "ditrun-fp8-fast-int8qkfp8v", "diffusers-compiled",
         "diffusers-torchao-fp8")
PEERS = ("diffusers", "diffusers-compiled", "diffusers-torchao-fp8")


# ---------------------------------------------------------------------------------------------
# Measuring


def gemm_ceilings(n: int = 8192) -> dict[str, float]:
    """TFLOP/s of a square BF16 GEMM and a row-wise scaled FP8 GEMM on random data, this GPU, now."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    ones = torch.ones(n, 1, device="cuda")
    flops = 2 * n**3
    bf16 = statistics.median(cuda_time(lambda: a @ b, 3, 10))
    fp8 = statistics.median(cuda_time(lambda: torch._scaled_mm(a8, b8.t(), scale_a=ones, scale_b=ones.t(),
                                                                out_dtype=torch.bfloat16), 3, 10))
    return {"bf16": flops / bf16 / 1e12, "fp8_rowwise": flops / fp8 / 1e12}


KERNEL_KINDS = (  # (kind, substrings of kernel names), first match wins
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "int8qk", "_fwd_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "scaled_mm", "matmul", "cublas", "sm90_", "wgmma")),
)


def kernel_breakdown(fn: Callable, top: int = 10) -> dict:
    """Kernel time of one call by kind (ms): attention, GEMM and the rest (norms, elementwise, copies);
    ``top_rest``: the ``top`` costliest kernels of the rest, (name, ms, calls), where fusion has work left;
    ``attention_kernels``: every kernel counted as attention, (name, ms, calls): which SDPA backend ran;
    ``top_gemm``: the ``top`` costliest GEMM kernels, (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals, rest, attention, gemms = {"attention": 0.0, "gemm": 0.0, "rest": 0.0}, [], [], []
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.key.lower()
        # Inductor's fused kernels (triton_poi_/triton_red_/triton_per_...) are named after every op they
        # touch: the norm + RoPE kernel that writes SDPA's inputs says "scaled_dot_product_..." and was once
        # counted as attention. They are the rest; ditrun's own Triton kernels have other names.
        fused = name.startswith(("triton_poi_", "triton_red_", "triton_per_"))
        kind = "rest" if fused else next((k for k, keys in KERNEL_KINDS if any(s in name for s in keys)), "rest")
        ms = event.self_device_time_total / 1e3
        totals[kind] += ms
        if kind == "rest":
            rest.append((event.key[:90], round(ms, 2), event.count))
        elif kind == "attention":
            attention.append((event.key[:120], round(ms, 2), event.count))
        else:
            gemms.append((event.key[:120], round(ms, 2), event.count))
    return {**totals, "top_rest": sorted(rest, key=lambda item: -item[1])[:top],
            "attention_kernels": sorted(attention, key=lambda item: -item[1]),
            "top_gemm": sorted(gemms, key=lambda item: -item[1])[:top]}


def kernel_text(name: str, ms: float, *calls: int) -> str:
    """One profiled kernel as printed: name, ms, and its call count where one was kept."""
    return f"{name} {ms}" + "".join(f" x{n}" for n in calls)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# ---------------------------------------------------------------------------------------------
# Models and inputs


def diffusers_model():
    from diffusers import FluxTransformer2DModel

    g = FLUX_DEV
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(
            num_layers=g.num_layers, num_single_layers=g.num_single_layers, attention_head_dim=g.attention_head_dim,
            num_attention_heads=g.num_attention_heads, joint_attention_dim=g.joint_attention_dim,
            pooled_projection_dim=g.pooled_projection_dim, guidance_embeds=True, axes_dims_rope=g.axes_dims_rope)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def make_inputs(tokens: int) -> dict:
    out_side, ref_side = SHAPES[tokens]
    ids = [token_ids(out_side // 8, out_side // 8, 0, "cuda")]
    if ref_side:
        ids.append(token_ids(ref_side // 8, ref_side // 8, 1, "cuda"))
    img_ids = torch.cat(ids)
    assert img_ids.shape[0] + TEXT == tokens, (img_ids.shape, tokens)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    return dict(
        hidden_states=torch.randn(1, img_ids.shape[0], 64, generator=gen, **bf16),
        encoder_hidden_states=torch.randn(1, TEXT, FLUX_DEV.joint_attention_dim, generator=gen, **bf16),
        pooled_projections=torch.randn(1, FLUX_DEV.pooled_projection_dim, generator=gen, **bf16),
        timestep=torch.tensor([0.6], device="cuda"), img_ids=img_ids,
        txt_ids=torch.zeros(TEXT, 3, device="cuda"), guidance=torch.tensor([3.5], device="cuda"))


COMPILE_TUNING = False
"""``--compile-tuning``: ditrun's modes compile with ``model.compile_tuning`` (inductor's coordinate descent)."""
CUDA_GRAPHS = False
"""``--cuda-graphs``: ditrun's compiled modes replay their forward from CUDA graphs (``model.cuda_graphs``)."""


def ditrun_forward(mode: str, weights: dict) -> Callable:
    """A forward of ditrun built as ``mode`` says, from diffusers' tensors (shared, not copied)."""
    spec = PRECISIONS[mode.removesuffix("-regions")]
    if isinstance(spec, dict):
        precision_cfg = PrecisionConfig(**spec)
    elif spec == "bf16":
        precision_cfg = PrecisionConfig()
    else:
        precision_cfg = PrecisionConfig(**yaml.safe_load((PRESET_DIR / f"{spec}.yaml").read_text()))
    placement = Placement(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, "bf16")
    plan = plan_precision(precision_cfg, placement.device)
    compiled = mode != "ditrun"
    compile_module.GELU_EPILOGUES = mode != "ditrun-compiled-no-epilogues"
    try:
        built = build_model(ModelConfig(preset="flux-dev"), placement, plan, announce=False, weights=weights,
                            speed=CompilePlan(compile=compiled, fuse=compiled, tuning=compiled and COMPILE_TUNING,
                                              graphs=compiled and CUDA_GRAPHS))
    finally:
        compile_module.GELU_EPILOGUES = True
    forward, attention = built.forward, built.attention
    if mode.endswith("-regions"):  # another function object: the block runs its compiled halves around it
        return lambda inputs: forward(**inputs, attention=lambda q, k, v: attention(q, k, v))
    return lambda inputs: forward(**inputs, attention=attention)


def diffusers_forward(model) -> Callable:
    return lambda inputs: model(**inputs, return_dict=False)[0]


def torchao_fp8(model) -> Optional[str]:
    """Quantize diffusers' linears as torchao's FP8 dynamic row-wise recipe does; None, or why not."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as err:
        return f"torchao is not importable ({err})"
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return None


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Row:
    mode: str
    tokens: int
    seconds: float
    first_call_s: float
    error: float
    kernels: dict
    clocks: dict
    """Mean SM clock (MHz) and board power (W) while the timed forwards ran (``nvidia-smi``; empty without it)."""

    @property
    def compile_s(self) -> float:
        return max(0.0, self.first_call_s - self.seconds)


class ClockSampler:
    """``nvidia-smi`` sampling this GPU's SM clock and power every 100 ms while the block runs: whether two modes
    ran at the same clocks (a denser forward can draw the board to its power limit and lower them)."""

    def __enter__(self) -> "ClockSampler":
        self.process = None
        if shutil.which("nvidia-smi") and torch.version.cuda:
            self.process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100",
                 "-i", str(torch.cuda.current_device())], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True)
        return self

    def __exit__(self, *exc) -> None:
        self.result = {}
        if self.process is None:
            return
        self.process.terminate()
        out, _ = self.process.communicate(timeout=10)
        samples = [[float(v) for v in line.split(",")] for line in out.splitlines() if line.count(",") == 1
                   and all(v.strip().replace(".", "", 1).isdigit() for v in line.split(","))]
        if samples:
            self.result = {"sm_mhz": statistics.mean(s[0] for s in samples),
                           "watts": statistics.mean(s[1] for s in samples), "samples": len(samples)}


def measure(mode: str, forward: Callable, tokens_list: list[int], references: dict, repeats: int,
            profile: bool) -> list[Row]:
    rows = []
    for tokens in tokens_list:
        inputs = make_inputs(tokens)
        with torch.inference_mode():
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = forward(inputs)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            if mode == "diffusers":
                references[tokens] = out.clone()
            with ClockSampler() as clocks:
                seconds = statistics.median(cuda_time(lambda: forward(inputs), 2, repeats))
            kernels = kernel_breakdown(lambda: forward(inputs)) if profile else {}
        rows.append(Row(mode, tokens, seconds, first, relative_error(out, references[tokens]), kernels, clocks.result))
        clock_text = f"  SM {clocks.result['sm_mhz']:.0f} MHz, {clocks.result['watts']:.0f} W" if clocks.result else ""
        print(f"  {mode:<22} {tokens:>6} tokens: {seconds * 1e3:8.1f} ms  error {rows[-1].error:.2e}  "
              f"first call {first:6.1f} s{clock_text}", flush=True)
    return rows


def run_modes(modes: list[str], tokens_list: list[int], repeats: int, profile: bool) -> tuple[list[Row], dict]:
    theirs = diffusers_model()
    weights = dict(theirs.state_dict())
    rows, references, skipped = [], {}, {}
    for mode in MODES:
        if mode not in modes:
            continue
        if mode.startswith("ditrun"):
            forward = ditrun_forward(mode, weights)
        elif mode == "diffusers":
            forward = diffusers_forward(theirs)
        else:
            if mode == "diffusers-torchao-fp8":
                why = torchao_fp8(theirs)
                if why is not None:
                    skipped[mode] = why
                    print(f"  {mode}: skipped, {why}", flush=True)
                    continue
                torch._dynamo.reset()
            theirs.compile_repeated_blocks(fullgraph=True)
            forward = diffusers_forward(theirs)
        rows += measure(mode, forward, tokens_list, references, repeats, profile)
        del forward
        if mode.startswith("ditrun"):
            torch._dynamo.reset()  # its compiled regions hold the model: free it before the next one
        gc.collect()
        torch.cuda.empty_cache()
    return rows, skipped


def ratio(rows: list[Row], row: Row, peer: str) -> Optional[float]:
    other = next((r for r in rows if r.mode == peer and r.tokens == row.tokens), None)
    return other.seconds / row.seconds if other else None


def print_tables(rows: list[Row], ceilings: dict) -> list[str]:
    """The table per shape, then the issue's targets as measured; returns the target lines."""
    print(f"\nGEMM ceilings (8192^3, random data): BF16 {ceilings['bf16']:.0f} TFLOP/s, "
          f"FP8 row-wise {ceilings['fp8_rowwise']:.0f} TFLOP/s")
    header = ("| tokens | mode | ms | TFLOP/s | % BF16 ceil. | error vs diffusers eager | x diffusers | "
              "x diffusers compiled | x torchao fp8 | attention ms | GEMM ms | rest ms | compile s |")
    print("\n" + header + "\n" + "|---" * (header.count("|") - 1) + "|")
    for row in sorted(rows, key=lambda r: (r.tokens, MODES.index(r.mode))):
        tflops = forward_flops(row.tokens - TEXT, TEXT) / row.seconds / 1e12
        ratios = [ratio(rows, row, peer) for peer in PEERS]
        k = row.kernels
        cells = [str(row.tokens), row.mode, f"{row.seconds * 1e3:.1f}", f"{tflops:.0f}",
                 f"{100 * tflops / ceilings['bf16']:.0f}", f"{row.error:.2e}",
                 *[f"{r:.2f}x" if r else "-" for r in ratios],
                 *[f"{k[kind]:.1f}" if k else "-" for kind in ("attention", "gemm", "rest")], f"{row.compile_s:.1f}"]
        print("| " + " | ".join(cells) + " |")
    return check_targets(rows)


def check_targets(rows: list[Row]) -> list[str]:
    def get(mode, tokens):
        return next((r for r in rows if r.mode == mode and r.tokens == tokens), None)

    lines = []
    torchao = {t: get("diffusers-torchao-fp8", t) for t in SHAPES}
    for mode in ("ditrun-krea", "ditrun-fp8-int8qk", "ditrun-fp8-fast-int8qk", "ditrun-fp8-fast-fp8attn",
                 "ditrun-fp8-fast-fp8pv", "ditrun-fp8-fast-int8qkfp8v"):
        row, peer = get(mode, 20992), torchao[20992]
        if row and peer:
            x = peer.seconds / row.seconds
            ok = x >= 1.25 and row.error <= peer.error
            lines.append(f"20992 tokens: {mode} {x:.2f}x torchao-fp8-compiled (target >= 1.25x), error "
                         f"{row.error:.2e} vs {peer.error:.2e}: {'met' if ok else 'missed'}")
    row, peer = get("ditrun-compiled", 20992), get("diffusers-compiled", 20992)
    if row and peer:
        x = peer.seconds / row.seconds
        lines.append(f"20992 tokens: ditrun BF16 compiled {x:.2f}x diffusers compiled (target >= 1.05x): "
                     f"{'met' if x >= 1.05 else 'missed'}")
    for tokens in (8704, 4608):
        peer = torchao[tokens]
        ours = [r for r in rows if r.tokens == tokens and r.mode.startswith("ditrun")]
        if peer and ours:
            best = min(ours, key=lambda r: r.seconds)
            x = peer.seconds / best.seconds
            lines.append(f"{tokens} tokens: fastest ditrun ({best.mode}) {x:.2f}x torchao-fp8-compiled "
                         f"(target >= 1.12x): {'met' if x >= 1.12 else 'missed'}")
    print("\nTargets:\n" + "\n".join("- " + line for line in lines))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel-time breakdown")
    parser.add_argument("--out", type=Path, default=None, help="write vs_diffusers.json here")
    parser.add_argument("--compile-tuning", action="store_true",
                        help="ditrun's compiled modes with model.compile_tuning=true (inductor's coordinate descent)")
    parser.add_argument("--fused-quantizer", action="store_true",
                        help="FP8 linears quantize [prefix | GELU(x)] with ditrun::act_rowwise_fp8, "
                        "not as inductor fuses it")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="ditrun's compiled modes replay their forward from CUDA graphs (model.cuda_graphs=on)")
    parser.add_argument("--tanh-gelu", action="store_true",
                        help="compiled regions keep GELU's tanh form (dit.GELU_AS_SIGMOID off), as before 2026-11-30")
    parser.add_argument("--triton-int8qk", action="store_true",
                        help="INT8-QK attention on the Triton kernel, not the Gluon one (attention.GLUON_INT8QK off)")
    args = parser.parse_args()
    global COMPILE_TUNING, CUDA_GRAPHS
    COMPILE_TUNING, CUDA_GRAPHS = args.compile_tuning, args.cuda_graphs
    dit.GELU_AS_SIGMOID = not args.tanh_gelu
    L.FUSED_ACTIVATION_QUANTIZER = args.fused_quantizer
    A.GLUON_INT8QK = not args.triton_int8qk
    if nothing_to_measure("vs_diffusers"):
        return 0
    if "diffusers" not in args.modes:
        args.modes.insert(0, "diffusers")  # the reference every error is measured against
    ceilings = gemm_ceilings()
    print(f"vs_diffusers: {torch.cuda.get_device_name()}, torch {torch.__version__}, modes {args.modes}, "
          f"tokens {args.tokens}, compile tuning {COMPILE_TUNING}, fused activation quantizer "
          f"{L.FUSED_ACTIVATION_QUANTIZER}, CUDA graphs {CUDA_GRAPHS}, GELU as sigmoid {dit.GELU_AS_SIGMOID}, "
          f"Gluon INT8-QK kernel {A.GLUON_INT8QK}", flush=True)
    rows, skipped = run_modes(args.modes, args.tokens, args.repeats, not args.no_profile)
    targets = print_tables(rows, ceilings)
    biggest = max(args.tokens)
    for title, key in (("Costliest kernels outside attention and GEMMs (ms)", "top_rest"),
                       ("Kernels counted as attention (name, ms, calls)", "attention_kernels"),
                       ("Costliest GEMM kernels (name, ms, calls)", "top_gemm")):
        print(f"\n{title}, largest shape:")
        for row in rows:
            if row.tokens == biggest and row.kernels:
                print(f"  {row.mode}: " + "; ".join(kernel_text(*kernel) for kernel in row.kernels[key]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vs_diffusers.json").write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings_tflops": ceilings,
            "compile_tuning": COMPILE_TUNING, "fused_activation_quantizer": L.FUSED_ACTIVATION_QUANTIZER,
            "cuda_graphs": CUDA_GRAPHS, "gelu_as_sigmoid": dit.GELU_AS_SIGMOID, "gluon_int8qk": A.GLUON_INT8QK,
            "skipped": skipped, "targets": targets,
            "rows": [{**row.__dict__, "compile_s": row.compile_s} for row in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
