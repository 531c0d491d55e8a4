"""Is ditrun's memory estimate right? One DiT forward per edit size with seeded random weights; the
measured peak (the ceiling: ``torch.cuda.max_memory_allocated`` on a GPU, the growth of the peak
resident set on a CPU) beside ``ditrun.model.memory``'s estimate, in one table.

    python benchmarks/memory_estimate.py                                  # flux-dev geometry, bf16, on the GPU
    python benchmarks/memory_estimate.py --device cpu --preset tiny --dtype fp32 --sizes 256 512

The refusal threshold is estimate > free memory, so an estimate/measured ratio at or a little
above 1 is what the check needs: below 1 lets through edits that then run out of memory.
"""

from __future__ import annotations

import argparse
import resource

import torch

from ditrun.model.load import random_model
from ditrun.model.memory import GIB, estimate, free_bytes, parameter_count
from ditrun.model.presets import PRESETS

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_forward(model, geometry, side: int, text_len: int, device, dtype) -> tuple[int, int]:
    """(tokens, peak bytes added by one forward) of an edit whose output and reference are side x side."""
    image_tokens = 2 * (side // 16) ** 2
    x = torch.randn(1, image_tokens, 64, device=device, dtype=dtype)
    text = torch.randn(1, text_len, geometry.joint_attention_dim, device=device, dtype=dtype)
    pooled = torch.randn(1, geometry.pooled_projection_dim, device=device, dtype=dtype)
    ids = torch.zeros(image_tokens, 3, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = peak_bytes(device) if device.type == "cpu" else torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model(
            x,
            text,
            pooled,
            torch.ones(1, device=device),
            ids,
            torch.zeros(text_len, 3, device=device),
            guidance=torch.ones(1, device=device) if geometry.guidance_embeds else None,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return text_len + image_tokens, peak_bytes(device) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flux-dev", choices=list(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--text-len", type=int, default=512)
    args = parser.parse_args()
    device, dtype, geometry = torch.device(args.device), DTYPES[args.dtype], PRESETS[args.preset]
    element = torch.empty(0, dtype=dtype).element_size()
    params = parameter_count(geometry)
    model = random_model(geometry, dtype=dtype, device=device)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else params * element
    print(
        f"{args.preset} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
        f"{args.dtype}; free now {free_bytes(device) / GIB:.1f} GiB; weights estimated "
        f"{params * element / GIB:.2f} GiB, allocated {weights / GIB:.2f} GiB"
    )
    print(f"{'size':>6} {'tokens':>8} {'estimated GiB':>14} {'measured GiB':>13} {'est/measured':>13}")
    for side in args.sizes:
        tokens, measured = measure_forward(model, geometry, side, args.text_len, device, dtype)
        estimated = estimate(geometry, tokens, side * side, element, element, params).activations
        print(
            f"{side:>6} {tokens:>8} {estimated / GIB:>14.3f} {measured / GIB:>13.3f} "
            f"{estimated / max(measured, 1):>13.2f}"
        )


if __name__ == "__main__":
    main()
