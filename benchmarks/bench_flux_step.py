"""One denoising step of a FLUX.1-dev-geometry DiT: ditrun's model next to diffusers', same weights.

A random checkpoint of the full 12B geometry is written with diffusers' ``save_pretrained``,
loaded back with ``ditrun.model.from_pretrained`` (meta -> safetensors onto the GPU), and both
models run the same Kontext-style edit inputs (output + reference image tokens + text). The
table compares forward and CFG-step (two forwards) times, checks that the outputs agree in
bf16, and sets the numbers against the bf16 matrix-multiply ceiling measured in the same run.

    python benchmarks/bench_flux_step.py --width 1024 --height 1024 --out results/bench

Needs a CUDA/ROCm GPU with ~60 GB free and diffusers installed; exits 0 with a message otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import FLUX_DEV, cuda_time, diffusers_flux_dev, forward_flops, nothing_to_measure

from ditrun.model import from_pretrained
from ditrun.model.latents import token_ids


def matmul_ceiling_tflops(n: int = 8192) -> float:
    """Measured bf16 GEMM rate on random data: the roofline this GPU reaches through PyTorch."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = statistics.median(cuda_time(lambda: a @ b, 3, 10))
    return 2 * n**3 / seconds / 1e12


def build_diffusers_checkpoint(folder: Path):
    model = diffusers_flux_dev()
    start = time.perf_counter()
    model.save_pretrained(folder, safe_serialization=True)
    return model, time.perf_counter() - start


def edit_inputs(width: int, height: int, text_len: int) -> dict:
    """Kontext-style inputs: output tokens then reference tokens, their ids, text, pooled, t, guidance."""
    h, w = height // 8, width // 8
    n = (h // 2) * (w // 2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    return dict(
        hidden_states=torch.randn(1, 2 * n, 64, generator=gen, **bf16),
        encoder_hidden_states=torch.randn(1, text_len, FLUX_DEV.joint_attention_dim, generator=gen, **bf16),
        pooled_projections=torch.randn(1, FLUX_DEV.pooled_projection_dim, generator=gen, **bf16),
        timestep=torch.tensor([0.6], device="cuda"),
        img_ids=torch.cat([token_ids(h, w, 0, "cuda"), token_ids(h, w, 1, "cuda")]),
        txt_ids=torch.zeros(text_len, 3, device="cuda"),
        guidance=torch.tensor([3.5], device="cuda"),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if nothing_to_measure("bench_flux_step"):
        return 0

    torch.backends.cuda.matmul.allow_tf32 = True
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "width": args.width,
        "height": args.height,
        "text_len": args.text_len,
    }
    results["matmul_ceiling_tflops"] = matmul_ceiling_tflops()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        folder = Path(tmp) / "flux-dev-random"
        theirs, results["save_s"] = build_diffusers_checkpoint(folder)
        start = time.perf_counter()
        ours = from_pretrained(folder, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        results["load_s"] = time.perf_counter() - start
        results["checkpoint_gb"] = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9

    inputs = edit_inputs(args.width, args.height, args.text_len)
    n_img = inputs["hidden_states"].shape[1]
    with torch.inference_mode():
        a = ours(**inputs).float()
        b = theirs(**inputs, return_dict=False)[0].float()
        results["rel_err_vs_diffusers"] = ((a - b).norm() / b.norm()).item()
        results["finite"] = bool(torch.isfinite(a).all())
        rows = {}
        for name, model, kw in (("ditrun", ours, {}), ("diffusers", theirs, {"return_dict": False})):
            forward = cuda_time(lambda: model(**inputs, **kw), 2, args.repeats)
            cfg_step = cuda_time(lambda: (model(**inputs, **kw), model(**inputs, **kw)), 1, args.repeats)
            rows[name] = {"forward_s": statistics.median(forward), "cfg_step_s": statistics.median(cfg_step)}
    flops = forward_flops(n_img, args.text_len)
    for row in rows.values():
        row["tflops"] = flops / row["forward_s"] / 1e12
        row["pct_of_ceiling"] = 100 * row["tflops"] / results["matmul_ceiling_tflops"]
    results["rows"] = rows
    results["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9

    print(
        f"\nFLUX.1-dev geometry, {args.width}x{args.height} edit ({n_img} image+reference tokens, "
        f"{args.text_len} text), bf16, {results['device']}, torch {results['torch']}"
    )
    print(
        f"checkpoint {results['checkpoint_gb']:.1f} GB: diffusers save {results['save_s']:.1f} s, "
        f"ditrun from_pretrained {results['load_s']:.1f} s; output rel. error vs diffusers "
        f"{results['rel_err_vs_diffusers']:.2e}"
    )
    print(f"{'model':<10} {'forward s':>10} {'CFG step s':>11} {'TFLOP/s':>8} {'% of GEMM ceiling':>18}")
    for name, row in rows.items():
        print(
            f"{name:<10} {row['forward_s']:>10.4f} {row['cfg_step_s']:>11.4f} {row['tflops']:>8.0f} "
            f"{row['pct_of_ceiling']:>17.0f}%"
        )
    print(f"bf16 GEMM ceiling (8192^3, random data): {results['matmul_ceiling_tflops']:.0f} TFLOP/s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_flux_step.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
