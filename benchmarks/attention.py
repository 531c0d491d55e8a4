"""Every quantized attention kernel against PyTorch SDPA in BF16 on one GPU, with the output error.

    python benchmarks/attention.py              # S = 20992 and 4608, 24 heads of 128, batch 1
    python benchmarks/attention.py --s 20992 --repeats 10
    python benchmarks/attention.py --configs --s 8704   # the Triton kernel's tile configurations
    python benchmarks/attention.py --cudnn-plans --s 20992   # every execution plan of cuDNN's FP8 attention

Rows: ``sdpa bf16`` (F.scaled_dot_product_attention, whatever backend PyTorch picks: the peer), each INT8-QK
implementation this GPU runs on operands quantized beforehand (``triton``; ``gluon``, the Hopper kernel, with
BF16 V and with its FP8 P @ V on V's codes), ``fp8_pv kernel only`` (cuDNN's fused FP8 attention on operands
quantized beforehand) and every quantized attention kernel end to end (operand quantization, torch.compile'd, +
kernel) with the implementation a model built here would choose (``attention.choose_implementation``). The
first call of each kernel autotunes it (untimed). Each time covers ``--calls`` back-to-back calls (default 5)
after one untimed call, SDPA's too: a call's Python (the operand quantization, the op's checks and descriptors)
then overlaps the GPU work of the call before, as in a model's stream of calls.
Error: max |out - SDPA in fp32| / max |SDPA in fp32| over the first 2048 queries (fp32 SDPA is
the exact reference; BF16 SDPA's own error is printed beside it for scale).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from harness import CUDA, print_table, relative_error, time_ms

from ditrun.kernels import fp8_sdpa
from ditrun.kernels.attention import (
    ATTENTION_KERNELS,
    choose_implementation,
    fp8_v_codes,
    gluon_unavailable,
    int8qk_attention_op,
    quantize_operands,
    quantize_v,
)
from ditrun.kernels.fp8_sdpa import dequantize_output, fp8_pv_operands, fp8_sdpa_op

ERROR_QUERIES = 2048


def sdpa(q, k, v):
    # [B, S, H, D] in and out, as the model's attention functions
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def fp32_reference(q, k, v):
    """Exact attention of the first ERROR_QUERIES queries, in fp32."""
    return sdpa(q[:, :ERROR_QUERIES].float(), k.float(), v.float())


def failure_text(failure: Exception) -> str:
    """A row's failure in one short line: its type and the first line of its message."""
    first = str(failure).splitlines()[0][:90] if str(failure) else ""
    return f"failed: {type(failure).__name__}: {first}"


class Inputs:
    """Seeded Q, K (with a key bias) and V [1, S, H, D] in BF16, the fp32 attention of their first
    ERROR_QUERIES queries, and SDPA's time on them: what every row is measured against."""

    def __init__(self, s: int, heads: int, head_dim: int, repeats: int, calls: int = 1):
        g = torch.Generator(device="cuda").manual_seed(0)
        self.q, self.k, self.v = (
            torch.randn(1, s, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)
        )
        self.k = self.k + 0.5 * torch.randn(1, 1, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
        self.exact = fp32_reference(self.q, self.k, self.v)
        self.s, self.flops, self.repeats, self.calls = s, 4 * s * s * heads * head_dim, repeats, calls
        self.base = time_ms(lambda: sdpa(self.q, self.k, self.v), CUDA, repeats, calls)

    def error(self, out: torch.Tensor) -> float:
        """out [1, S, H, D] against the fp32 reference, over its first ERROR_QUERIES queries."""
        return relative_error(out[:, :ERROR_QUERIES], self.exact)

    def row(self, kernel: str, fn, error: bool = True, optional: bool = False) -> dict[str, str]:
        """``fn`` timed (and, with ``error``, its [1, S, H, D] output checked) as one table row. For an
        ``optional`` row a failure is a row that says why: one kernel that cannot run here must not end the table."""
        try:
            ms = time_ms(fn, CUDA, self.repeats, self.calls)
            err = f"{self.error(fn()):.1e}" if error else "-"
        except Exception as failure:  # noqa: BLE001 - an optional row says why it could not run and goes on
            if not optional:
                raise
            return {
                "S": str(self.s),
                "kernel": kernel,
                "ms": "-",
                "TF/s": "-",
                "vs sdpa": "-",
                "error": failure_text(failure),
            }
        return self._row(kernel, ms, err)

    def sdpa_row(self, error: bool = True) -> dict[str, str]:
        """SDPA's own row, from the time measured at construction."""
        err = f"{self.error(sdpa(self.q, self.k, self.v)):.1e}" if error else "-"
        return self._row("sdpa bf16", self.base, err)

    def _row(self, kernel: str, ms: float, err: str) -> dict[str, str]:
        return {
            "S": str(self.s),
            "kernel": kernel,
            "ms": f"{ms:.3f}",
            "TF/s": f"{self.flops / ms / 1e9:.0f}",
            "vs sdpa": f"{self.base / ms:.2f}x",
            "error": err,
        }


def bench(s: int, heads: int, head_dim: int, repeats: int, calls: int = 1) -> list[dict[str, str]]:
    x = Inputs(s, heads, head_dim, repeats, calls)
    q, k, v = x.q, x.k, x.v
    sm_scale = 1 / math.sqrt(head_dim)
    rows = [x.sdpa_row()]
    ops = {v_format: quantize_operands(q, k, v, v_format) for v_format in ("bf16", "fp8")}
    implementations = ["triton"] + (["gluon"] if gluon_unavailable(CUDA, True) is None else [])
    for implementation in implementations:  # the kernels on operands quantized beforehand
        for v_format, o in ops.items():
            v_operand, v_scale = o.v, None
            if implementation == "gluon" and v_format == "fp8":  # the FP8 P @ V takes V's codes
                v_operand, v_scale = fp8_v_codes(o.v)
            args = (o.q, o.q_scale, o.k, o.k_scale, v_operand, sm_scale, implementation, v_scale)
            rows.append(
                x.row(
                    f"int8qk {implementation} kernel only ({v_format} V)",
                    lambda args=args: int8qk_attention_op(*args).transpose(1, 2),
                )
            )
    fp8_pv = fp8_pv_operands(q, k, v)  # the vendor's fused FP8 kernel (cuDNN here) on operands quantized beforehand
    rows.append(
        x.row(
            f"fp8_pv kernel only ({fp8_sdpa.BACKEND})",
            lambda: dequantize_output(fp8_sdpa_op(*fp8_pv, sm_scale), fp8_pv[3], torch.bfloat16),
            optional=True,
        )
    )
    for name, kernel in ATTENTION_KERNELS.items():
        if not kernel.quantized:
            continue
        implementation = choose_implementation(kernel, CUDA, head_dim, fast=True)
        attention = kernel.make(implementation)
        rows.append(
            x.row(
                f"{name} ({implementation})",
                lambda attention=attention: attention(q, k, v),
                optional=implementation == "emulation",
            )
        )
    return rows


# The Triton kernel's configurations --configs compares: (BLOCK_M, BLOCK_N, warps, stages).
TILE_CONFIGS = [
    (128, 64, 4, 3),
    (128, 64, 4, 2),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (64, 64, 4, 3),
]


def config_rows(s: int, heads: int, head_dim: int, repeats: int) -> list[dict[str, str]]:
    """The Triton flash kernel on INT8 Q.K operands with BF16 and with FP8-exact V under every TILE_CONFIGS entry,
    on operands quantized beforehand: which tiles are fastest on this GPU (``attention_triton.CONFIGS`` lists the
    autotuner's), with each one's error."""
    from ditrun.kernels.attention_triton import flash_attention

    x = Inputs(s, heads, head_dim, repeats)
    q, k, v = x.q, x.k, x.v
    rows = [x.sdpa_row(error=False)]
    int8 = quantize_operands(q, k, v, "bf16")
    v_bf16, v_fp8 = v.transpose(1, 2).contiguous(), quantize_v(v.transpose(1, 2), "fp8").contiguous()
    variants = {
        "bf16 V": (int8.q, int8.q_scale, int8.k, int8.k_scale, v_bf16),
        "fp8 V": (int8.q, int8.q_scale, int8.k, int8.k_scale, v_fp8),
    }
    for name, operands in variants.items():
        for bm, bn, warps, stages in TILE_CONFIGS:
            config = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            rows.append(
                x.row(
                    f"{name} [{bm}x{bn} w{warps} s{stages}]",
                    lambda operands=operands, config=config: flash_attention(
                        *operands, 1 / math.sqrt(head_dim), config
                    ).transpose(1, 2),
                    optional=True,
                )
            )
            print(rows[-1], flush=True)
    return rows


def cudnn_plan_rows(s: int, heads: int, head_dim: int, repeats: int, calls: int) -> list[dict[str, str]]:
    """cuDNN's FP8 attention (``fp8_pv``) on operands quantized beforehand: the plan its heuristics rank first (what
    ditrun runs) and then every plan its heuristics A, B and the fallback offer, each run by index, with its error."""
    x = Inputs(s, heads, head_dim, repeats, calls)
    sm_scale = 1 / math.sqrt(head_dim)
    *codes, scales = fp8_pv_operands(x.q, x.k, x.v)
    rows = [x.sdpa_row()]
    rows.append(
        x.row(
            "fp8_pv, the heuristics' first plan (ditrun's)",
            lambda: dequantize_output(fp8_sdpa_op(*codes, scales, sm_scale), scales, torch.bfloat16),
        )
    )
    graph = fp8_sdpa.CudnnGraph(tuple(codes[0].shape), tuple(codes[1].shape), sm_scale, codes[0].device, True)
    for index, name in graph.plans:
        rows.append(
            x.row(
                f"fp8_pv plan {index}: {name}",
                lambda index=index: dequantize_output(graph(*codes, scales, plan=index), scales, torch.bfloat16),
                optional=True,
            )
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--s", type=int, nargs="*", default=[20992, 4608])
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--calls",
        type=int,
        default=5,
        help="back-to-back calls per timing: each call's host launch overlaps the previous call's GPU "
        "work, as in a model (1: the launch counts too)",
    )
    parser.add_argument(
        "--configs", action="store_true", help="only the Triton kernel's operand variants x tile configurations"
    )
    parser.add_argument(
        "--cudnn-plans", action="store_true", help="only cuDNN's FP8 attention, every execution plan it offers"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA/ROCm GPU with Triton")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.heads} heads of {args.head_dim}")
    if args.cudnn_plans:
        rows = [row for s in args.s for row in cudnn_plan_rows(s, args.heads, args.head_dim, args.repeats, args.calls)]
        print_table(rows)
        return
    if args.configs:
        print_table([row for s in args.s for row in config_rows(s, args.heads, args.head_dim, args.repeats)])
        return
    print_table([row for s in args.s for row in bench(s, args.heads, args.head_dim, args.repeats, args.calls)])


if __name__ == "__main__":
    main()
