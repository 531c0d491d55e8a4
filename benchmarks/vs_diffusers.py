"""ditrun's DiT against diffusers' fastest Flux recipes, side by side, on one GPU, same weights.

One process, one random FLUX.1-dev-geometry checkpoint (diffusers' own random init, bf16, on
the GPU). Every ditrun model is built from diffusers' tensors in memory (``build_model(...,
weights=...)``: assigned, not copied), so both sides compute with the same numbers. Per mode and
per shape: CUDA-event median of one forward after warm-up, TFLOP/s against the GEMM ceilings
measured first, the output's relative error against diffusers eager BF16 (the reference: every
row prints its error beside its time, so no faster-but-wrong mode passes unseen), ratios against
every diffusers row, and a kernel-time breakdown (attention / GEMM / rest) from the profiler, with the
costliest kernels of the rest in a table: ms, calls, the bytes each call must move (Inductor's own count of
its kernel's inputs and outputs) and the rate that makes, against a device-to-device copy measured first.

Modes (``--modes``; default all, in this order, because diffusers' rows change its model in place):

* ``diffusers``            eager BF16 (the reference output)
* ``ditrun``               eager BF16, what ``model.compile=off`` runs
* ``ditrun-<preset>``      the model ``ditrun model=flux-dev precision=<preset>`` runs on this GPU, one mode per
                           file in ``ditrun/conf/precision/`` (composed by Hydra, as the CLI composes it: the
                           preset's keys, ``model.compile``, ``model.cuda_graphs`` and the rest at their values
                           there); ``ditrun-fp8_all`` is the fast path
* ``ditrun-<preset>-regions`` (bf16, fp8_all) the same with the attention between the compiled halves, as a
                           layout that exchanges runs it (``ulysses``, ``cfg_*``): what leaving it out costs
* ``diffusers-compiled``   ``compile_repeated_blocks(fullgraph=True)``
* ``diffusers-torchao-fp8`` torchao ``Float8DynamicActivationFloat8WeightConfig(PerRow())`` + the same compile

A ditrun mode may carry overrides of its own after ``@`` (``ditrun-fp8_all@precision.quantizer=kernel``, several
joined by commas): it runs after its plain mode, so one process compares them.

``--set KEY=VALUE ...``: Hydra overrides for every ditrun mode (``--set precision.attention=int8qk_fp8v``,
``--set model.compile_tuning=false``). Each ditrun row prints what ran (linear backends, attention
implementation, compile mode) as the run's summary records it.

Shapes (``--tokens``; image + reference + text tokens): 8704 (Kontext 1 MP edit: 4096 out +
4096 ref + 512 text), 20992 (4 MP out + 1 MP ref + 512 text), 4608 (1 MP generation).

    python benchmarks/vs_diffusers.py --out results/vs                # everything
    python benchmarks/vs_diffusers.py --modes diffusers ditrun-fp8_all diffusers-torchao-fp8 --tokens 20992

Needs a GPU with ~90 GB free, diffusers (and torchao for its row); exits 0 with a message otherwise.
Compile time per mode is the first call's wall time minus a steady call (printed apart).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from harness import cuda_time, diffusers_flux_dev, forward_flops, nothing_to_measure  # the same model and FLOP count

from ditrun.config import (
    precision_presets,
    register_configs,
)
from ditrun.model.build import build_model, select_device_dtype
from ditrun.model.compile import plan_compile
from ditrun.model.latents import token_ids
from ditrun.model.precision import plan_precision
from ditrun.model.presets import PRESETS

FLUX_DEV = PRESETS["flux-dev"]
TEXT = 512
SHAPES = {  # total tokens -> (output side px, reference side px or 0): 1 MP = 1024 x 1024
    8704: (1024, 1024),
    20992: (2048, 1024),
    4608: (1024, 0),
}
PRESETS_HERE = sorted(precision_presets(), key=lambda name: (name != "bf16", name))
"""The precision presets, bf16 first: one ditrun mode each."""
MODES = (
    "diffusers",
    "ditrun",
    *(f"ditrun-{preset}" for preset in PRESETS_HERE),
    "ditrun-bf16-regions",
    "ditrun-fp8_all-regions",
    "diffusers-compiled",
    "diffusers-torchao-fp8",
)
PEERS = ("diffusers", "diffusers-compiled", "diffusers-torchao-fp8")


# ---------------------------------------------------------------------------------------------
# Measuring


def copy_ceiling_tbs(nbytes: int = 2**30) -> float:
    """TB/s of a device-to-device copy of ``nbytes`` (bytes read plus bytes written), this GPU, now: the memory
    ceiling a kernel that reads and writes once is held against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / statistics.median(cuda_time(lambda: dst.copy_(src), 3, 10)) / 1e12


def gemm_ceilings(n: int = 8192) -> dict[str, float]:
    """TFLOP/s of a square BF16 GEMM and a row-wise scaled FP8 GEMM on random data, this GPU, now."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    ones = torch.ones(n, 1, device="cuda")
    flops = 2 * n**3
    bf16 = statistics.median(cuda_time(lambda: a @ b, 3, 10))
    fp8 = statistics.median(
        cuda_time(lambda: torch._scaled_mm(a8, b8.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16), 3, 10)
    )
    return {"bf16": flops / bf16 / 1e12, "fp8_rowwise": flops / fp8 / 1e12, "copy_tbs": copy_ceiling_tbs()}


KERNEL_KINDS = (  # (kind, substrings of kernel names), first match wins
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "int8qk", "_fwd_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "scaled_mm", "matmul", "cublas", "sm90_", "wgmma")),
)


def inductor_kernel_gb(skip: set) -> dict[str, float]:
    """Inductor kernel name -> GB one call reads and writes (``kernel_num_gb``: its buffers' sizes, which Inductor
    records where ``config.benchmark_kernel`` is set), from the generated modules not in ``skip`` (file paths)."""
    from torch._inductor.codecache import PyCodeCache

    modules = PyCodeCache.modules
    gb = {}
    for module in modules.values() if isinstance(modules, dict) else modules:
        path = getattr(module, "__file__", None)
        if not path or path in skip:
            continue
        skip.add(path)
        for line in Path(path).read_text().splitlines():
            name = re.search(r"'kernel_name': '(\w+)'", line)
            size = re.search(r"'kernel_num_gb': ([0-9.eE+-]+)", line)
            if "inductor_meta" in line and name and size:
                gb[name.group(1)] = float(size.group(1))
    return gb


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
        # touch: the norm + RoPE kernel that writes SDPA's inputs says "scaled_dot_product_...", which is not
        # attention. They are the rest; ditrun's own Triton kernels have other names.
        fused = name.startswith(("triton_poi_", "triton_red_", "triton_per_"))
        kind = "rest" if fused else next((k for k, keys in KERNEL_KINDS if any(s in name for s in keys)), "rest")
        ms = event.self_device_time_total / 1e3
        totals[kind] += ms
        if kind == "rest":
            rest.append((event.key, round(ms, 3), event.count))
        elif kind == "attention":
            attention.append((event.key[:120], round(ms, 2), event.count))
        else:
            gemms.append((event.key[:120], round(ms, 2), event.count))
    return {
        **totals,
        "top_rest": sorted(rest, key=lambda item: -item[1])[: 3 * top],
        "attention_kernels": sorted(attention, key=lambda item: -item[1]),
        "top_gemm": sorted(gemms, key=lambda item: -item[1])[:top],
    }


def kernel_text(name: str, ms: float, *calls: int) -> str:
    """One profiled kernel as printed: name, ms, and its call count where one was kept."""
    return f"{name} {ms}" + "".join(f" x{n}" for n in calls)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# ---------------------------------------------------------------------------------------------
# Models and inputs


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
        timestep=torch.tensor([0.6], device="cuda"),
        img_ids=img_ids,
        txt_ids=torch.zeros(TEXT, 3, device="cuda"),
        guidance=torch.tensor([3.5], device="cuda"),
    )


def base_mode(mode: str) -> str:
    """A mode without the overrides of its own (``ditrun-fp8_all@precision.quantizer=kernel`` -> ``ditrun-fp8_all``)."""
    return mode.partition("@")[0]


def mode_overrides(mode: str) -> list[str]:
    """The overrides a mode carries after ``@``."""
    return [item for item in mode.partition("@")[2].split(",") if item]


def ditrun_config(mode: str, overrides: list[str]):
    """The run config the CLI composes for ``mode`` (``ditrun``: eager BF16; ``ditrun-<preset>[-regions]``) on the
    FLUX.1-dev geometry and this GPU, with ``overrides`` (``--set``) and then the mode's own last."""
    from hydra import compose, initialize_config_module

    overrides = [*overrides, *mode_overrides(mode)]
    mode = base_mode(mode)
    preset = mode.removeprefix("ditrun").removeprefix("-").removesuffix("-regions") or "bf16"
    eager = ["model.compile=off"] if mode == "ditrun" else []
    register_configs()
    with initialize_config_module("ditrun.conf", version_base="1.3"):
        return compose("config", overrides=["model=flux-dev", f"precision={preset}", "device=cuda", *eager, *overrides])


def ditrun_forward(mode: str, weights: dict, overrides: list[str]) -> tuple[Callable, dict]:
    """A forward of ditrun built as the CLI builds ``mode``'s config, from diffusers' tensors (shared, not copied),
    and what it runs (the summary's ``precision_detail``)."""
    cfg = ditrun_config(mode, overrides)
    device_dtype = select_device_dtype(cfg.device, cfg.model.dtype)
    plan = plan_precision(cfg.precision, device_dtype.device)
    built = build_model(
        cfg.model, device_dtype, plan, weights=weights, compile_plan=plan_compile(cfg.model, device_dtype.device)
    )
    forward, attention = built.forward, built.attention
    ran = {"precision": cfg.precision.name, **built.details}
    if base_mode(mode).endswith("-regions"):  # another function object: the block runs its compiled halves around it
        return lambda inputs: forward(**inputs, attention=lambda q, k, v: attention(q, k, v)), ran
    return lambda inputs: forward(**inputs, attention=attention), ran


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
    ran: dict = field(default_factory=dict)
    """ditrun's rows: what the model ran (format and backends per component, attention implementation, compile)."""

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
                [
                    "nvidia-smi",
                    "--query-gpu=clocks.sm,power.draw",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "100",
                    "-i",
                    str(torch.cuda.current_device()),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self

    def __exit__(self, *exc) -> None:
        self.result = {}
        if self.process is None:
            return
        self.process.terminate()
        out, _ = self.process.communicate(timeout=10)
        samples = [
            [float(v) for v in line.split(",")]
            for line in out.splitlines()
            if line.count(",") == 1 and all(v.strip().replace(".", "", 1).isdigit() for v in line.split(","))
        ]
        if samples:
            self.result = {
                "sm_mhz": statistics.mean(s[0] for s in samples),
                "watts": statistics.mean(s[1] for s in samples),
                "samples": len(samples),
            }


def measure(
    mode: str,
    forward: Callable,
    tokens_list: list[int],
    references: dict,
    repeats: int,
    profile: bool,
    ran: Optional[dict] = None,
) -> list[Row]:
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
        rows.append(
            Row(
                mode, tokens, seconds, first, relative_error(out, references[tokens]), kernels, clocks.result, ran or {}
            )
        )
        clock_text = f"  SM {clocks.result['sm_mhz']:.0f} MHz, {clocks.result['watts']:.0f} W" if clocks.result else ""
        print(
            f"  {mode:<22} {tokens:>6} tokens: {seconds * 1e3:8.1f} ms  error {rows[-1].error:.2e}  "
            f"first call {first:6.1f} s{clock_text}",
            flush=True,
        )
    return rows


def run_modes(
    modes: list[str], tokens_list: list[int], repeats: int, profile: bool, overrides: list[str]
) -> tuple[list[Row], dict]:
    theirs = diffusers_flux_dev()
    weights = dict(theirs.state_dict())
    rows, references, skipped, seen_modules = [], {}, {}, set()
    for mode in sorted(modes, key=lambda m: MODES.index(base_mode(m))):  # stable: variants after their mode
        ran = None
        if mode.startswith("ditrun"):
            forward, ran = ditrun_forward(mode, weights, overrides)
            print(f"  {mode}: {json.dumps(ran)}", flush=True)
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
        rows += measure(mode, forward, tokens_list, references, repeats, profile, ran)
        if profile:
            gb = inductor_kernel_gb(seen_modules)
            for row in rows:
                if row.mode == mode and row.kernels:
                    row.kernels["kernel_gb"] = {name: gb[name] for name, *_ in row.kernels["top_rest"] if name in gb}
        del forward
        if mode.startswith("ditrun"):
            torch._dynamo.reset()  # its compiled regions hold the model: free it before the next one
        gc.collect()
        torch.cuda.empty_cache()
    return rows, skipped


def ratio(rows: list[Row], row: Row, peer: str) -> Optional[float]:
    other = next((r for r in rows if r.mode == peer and r.tokens == row.tokens), None)
    return other.seconds / row.seconds if other else None


def print_tables(rows: list[Row], ceilings: dict) -> None:
    """One table: every mode at every shape, against the GEMM ceilings and each peer."""
    print(
        f"\nGEMM ceilings (8192^3, random data): BF16 {ceilings['bf16']:.0f} TFLOP/s, "
        f"FP8 row-wise {ceilings['fp8_rowwise']:.0f} TFLOP/s; device copy {ceilings['copy_tbs']:.2f} TB/s"
    )
    header = (
        "| tokens | mode | ms | TFLOP/s | % BF16 ceil. | error vs diffusers eager | x diffusers | "
        "x diffusers compiled | x torchao fp8 | attention ms | GEMM ms | rest ms | compile s |"
    )
    print("\n" + header + "\n" + "|---" * (header.count("|") - 1) + "|")
    for row in sorted(rows, key=lambda r: (r.tokens, MODES.index(base_mode(r.mode)))):
        tflops = forward_flops(row.tokens - TEXT, TEXT) / row.seconds / 1e12
        ratios = [ratio(rows, row, peer) for peer in PEERS]
        k = row.kernels
        cells = [
            str(row.tokens),
            row.mode,
            f"{row.seconds * 1e3:.1f}",
            f"{tflops:.0f}",
            f"{100 * tflops / ceilings['bf16']:.0f}",
            f"{row.error:.2e}",
            *[f"{r:.2f}x" if r else "-" for r in ratios],
            *[f"{k[kind]:.1f}" if k else "-" for kind in ("attention", "gemm", "rest")],
            f"{row.compile_s:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")


def print_rest_table(rows: list[Row], tokens: int, ceilings: dict, top: int = 12) -> None:
    """Per ditrun mode at ``tokens``: the costliest kernels outside attention and GEMMs, with the GB a call moves
    (Inductor's count; "-" for kernels that are not Inductor's) and the rate against the measured copy ceiling."""
    for row in rows:
        if row.tokens != tokens or not row.kernels or not row.mode.startswith("ditrun"):
            continue
        gb = row.kernels.get("kernel_gb", {})
        print(f"\nThe rest, {row.mode}, {tokens} tokens ({row.kernels['rest']:.1f} ms in all):")
        print("| kernel | ms | calls | GB per call | TB/s | % of copy |\n|---|---|---|---|---|---|")
        for name, ms, calls in row.kernels["top_rest"][:top]:
            moved = gb.get(name)
            rate = moved * calls / ms if moved else None  # GB/ms = TB/s
            cells = [name[:80], f"{ms:.2f}", str(calls), f"{moved:.3f}" if moved else "-"]
            cells += [f"{rate:.2f}", f"{100 * rate / ceilings['copy_tbs']:.0f}"] if rate else ["-", "-"]
            print("| " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), help=f"any of {', '.join(MODES)}; a ditrun "
                        "mode may carry overrides: MODE@KEY=VALUE[,KEY=VALUE]")  # fmt: skip
    parser.add_argument("--tokens", nargs="+", type=int, default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel-time breakdown")
    parser.add_argument("--out", type=Path, default=None, help="write vs_diffusers.json here")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="Hydra overrides for every ditrun mode (e.g. model.compile_tuning=false)",
    )
    args = parser.parse_args()
    unknown = [m for m in args.modes if base_mode(m) not in MODES or (m != base_mode(m) and "ditrun" not in m)]
    if unknown:
        parser.error(f"--modes {' '.join(unknown)}: allowed: {', '.join(MODES)}, a ditrun mode with @overrides")
    if nothing_to_measure("vs_diffusers"):
        return 0
    if not args.no_profile:  # each Inductor kernel records the bytes it moves: the rest's table prints them
        torch._inductor.config.benchmark_kernel = True
    if "diffusers" not in args.modes:
        args.modes.insert(0, "diffusers")  # the reference every error is measured against
    ceilings = gemm_ceilings()
    print(
        f"vs_diffusers: {torch.cuda.get_device_name()}, torch {torch.__version__}, modes {args.modes}, "
        f"tokens {args.tokens}, overrides {args.set}",
        flush=True,
    )
    rows, skipped = run_modes(args.modes, args.tokens, args.repeats, not args.no_profile, args.set)
    print_tables(rows, ceilings)
    biggest = max(args.tokens)
    print_rest_table(rows, biggest, ceilings)
    for title, key in (
        ("Costliest kernels outside attention and GEMMs (ms)", "top_rest"),
        ("Kernels counted as attention (name, ms, calls)", "attention_kernels"),
        ("Costliest GEMM kernels (name, ms, calls)", "top_gemm"),
    ):
        print(f"\n{title}, largest shape:")
        for row in rows:
            if row.tokens == biggest and row.kernels:
                kernels = row.kernels[key][:10]
                print(f"  {row.mode}: " + "; ".join(kernel_text(name[:90], *rest) for name, *rest in kernels))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vs_diffusers.json").write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "ceilings_tflops": ceilings,
                    "overrides": args.set,
                    "skipped": skipped,
                    "rows": [{**row.__dict__, "compile_s": row.compile_s} for row in rows],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
