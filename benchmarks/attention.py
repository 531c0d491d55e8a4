"""INT8-QK attention (Triton) against PyTorch SDPA in BF16 on one GPU, with the output error.

    python benchmarks/attention.py              # S = 20992 and 4608, 24 heads of 128, batch 1
    python benchmarks/attention.py --s 20992 --repeats 10
    python benchmarks/attention.py --gluon --s 20992 8704 4608   # the Hopper Gluon kernel's options vs Triton
    python benchmarks/attention.py --fp8-pv on --s 20992   # int8qk_fp8v with the Hopper kernel's FP8 P @ V

Rows: ``sdpa bf16`` (F.scaled_dot_product_attention, whatever backend PyTorch picks: the peer),
``int8qk kernel only`` (``ditrun::int8qk_attention`` on operands quantized beforehand, with BF16 V and with
FP8-exact V: the Gluon kernel on Hopper, the autotuned Triton kernel elsewhere), ``fp8_pv kernel only``
(cuDNN's fused FP8 attention on operands quantized beforehand) and every quantized attention kernel end to
end (operand quantization, torch.compile'd, + kernel), as the model calls it. The first call of each kernel
autotunes it (untimed). ``--gluon`` compares the Gluon kernel's options with the Triton kernel; ``--ncu``
makes one launch of each for Nsight Compute.
Each time covers ``--calls`` back-to-back calls (default 5) after one untimed call, SDPA's too: a call's Python (the
operand quantization, the op's checks and descriptors) then overlaps the GPU work of the call before, as in a
model's stream of calls.
Timed one call at a time, the host's launch counted as well: up to 0.45 ms of the Gluon kernel's row and 1.6 ms of
``int8qk_fp8v``'s at 20992 tokens (one H200, session 6).
Error: max |out - SDPA in fp32| / max |SDPA in fp32| over the first 2048 queries (fp32 SDPA is
the exact reference; BF16 SDPA's own error is printed beside it for scale).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditrun.kernels.attention import (ATTENTION_KERNELS, fp8_v_codes, gluon_fp8_pv_runs,  # noqa: E402
                                     int8qk_attention_op, quantize_fp8_heads, quantize_operands, quantize_v, smooth_k)
from ditrun.kernels import fp8_sdpa  # noqa: E402
from ditrun.kernels.fp8_sdpa import dequantize_output, fp8_pv_operands, fp8_sdpa_op  # noqa: E402
from gemm import CUDA, print_table, relative_error  # noqa: E402
from ditrun.kernels.tune import time_ms  # noqa: E402

ERROR_QUERIES = 2048


def sdpa(q, k, v):
    # [B, S, H, D] in and out, as the model's attention functions
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def fp32_reference(q, k, v):
    """Exact attention of the first ERROR_QUERIES queries, in fp32."""
    return sdpa(q[:, :ERROR_QUERIES].float(), k.float(), v.float())


def failure_text(failure: Exception) -> str:
    """A probe's failure in one short line: its type and the first line of its message."""
    first = str(failure).splitlines()[0][:90] if str(failure) else ""
    return f"failed: {type(failure).__name__}: {first}"


class Inputs:
    """Seeded Q, K (with a key bias) and V [1, S, H, D] in BF16, the fp32 attention of their first
    ERROR_QUERIES queries, and SDPA's time on them: what every row is measured against."""

    def __init__(self, s: int, heads: int, head_dim: int, repeats: int, calls: int = 1):
        g = torch.Generator(device="cuda").manual_seed(0)
        self.q, self.k, self.v = (torch.randn(1, s, heads, head_dim, device="cuda", generator=g,
                                              dtype=torch.bfloat16) for _ in range(3))
        self.k = self.k + 0.5 * torch.randn(1, 1, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
        self.exact = fp32_reference(self.q, self.k, self.v)
        self.s, self.flops, self.repeats, self.calls = s, 4 * s * s * heads * head_dim, repeats, calls
        self.base = time_ms(lambda: sdpa(self.q, self.k, self.v), CUDA, repeats, calls)

    def error(self, out: torch.Tensor) -> float:
        """out [1, S, H, D] against the fp32 reference, over its first ERROR_QUERIES queries."""
        return relative_error(out[:, :ERROR_QUERIES], self.exact)

    def row(self, kernel: str, fn, error: bool = True, probe: bool = False) -> dict[str, str]:
        """``fn`` timed (and, with ``error``, its [1, S, H, D] output checked) as one table row. For a
        ``probe`` a failure is a row that says why: one variant that cannot run must not end the table."""
        try:
            ms = time_ms(fn, CUDA, self.repeats, self.calls)
            err = f"{self.error(fn()):.1e}" if error else "-"
        except Exception as failure:  # noqa: BLE001 - a probe says why it could not run and goes on
            if not probe:
                raise
            return {"S": str(self.s), "kernel": kernel, "ms": "-", "TF/s": "-", "vs sdpa": "-",
                    "error": failure_text(failure)}
        return self._row(kernel, ms, err)

    def sdpa_row(self, error: bool = True) -> dict[str, str]:
        """SDPA's own row, from the time measured at construction."""
        err = f"{self.error(sdpa(self.q, self.k, self.v)):.1e}" if error else "-"
        return self._row("sdpa bf16", self.base, err)

    def _row(self, kernel: str, ms: float, err: str) -> dict[str, str]:
        return {"S": str(self.s), "kernel": kernel, "ms": f"{ms:.3f}", "TF/s": f"{self.flops / ms / 1e9:.0f}",
                "vs sdpa": f"{self.base / ms:.2f}x", "error": err}


def bench(s: int, heads: int, head_dim: int, repeats: int, probe: bool = False, calls: int = 1) -> list[dict[str, str]]:
    x = Inputs(s, heads, head_dim, repeats, calls)
    q, k, v = x.q, x.k, x.v
    rows = [x.sdpa_row()]
    for v_format in ("bf16", "fp8"):  # the kernel on operands quantized beforehand (FP8 V: as the model hands it)
        ops = quantize_operands(q, k, v, v_format)
        v_operand, v_scale = ops.v, None
        if v_format == "fp8" and gluon_fp8_pv_runs(q, v):  # the FP8 P @ V's operand, made by the quantization
            v_operand, v_scale = fp8_v_codes(ops.v)
        args = (ops.q, ops.q_scale, ops.k, ops.k_scale, v_operand, 1 / math.sqrt(head_dim), v_format == "fp8")
        rows.append(x.row(f"int8qk kernel only ({v_format} V)",
                          lambda: int8qk_attention_op(*args, v_scale=v_scale).transpose(1, 2)))
    fp8_pv = fp8_pv_operands(q, k, v)  # the vendor's fused FP8 kernel (cuDNN here) on operands quantized beforehand
    rows.append(x.row(f"fp8_pv kernel only ({fp8_sdpa.BACKEND})",
                      lambda: dequantize_output(fp8_sdpa_op(*fp8_pv, 1 / math.sqrt(head_dim)), fp8_pv[3],
                                                torch.bfloat16), probe=True))
    for name in ("int8qk", "int8qk_fp8v", "int8qk_mxfp6v", "fp8", "fp8_pv"):
        attention = ATTENTION_KERNELS.get(name, "--kernel").make(True)
        rows.append(x.row(name, lambda: attention(q, k, v), probe=name == "fp8_pv"))
    if probe:
        rows += flex_rows(x)
    return rows


def flex_rows(x: Inputs) -> list[dict[str, str]]:
    """FlexAttention (Triton, from inductor) in BF16 and on FP8 E4M3 operands, beside SDPA: a probe
    for an FP8 attention kernel (``dot`` on FP8 runs Hopper's FP8 tensor cores at twice BF16's rate)."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (x.q, x.k, x.v))  # [B, H, S, D]
    kt = kt - kt.mean(dim=2, keepdim=True)  # smoothing: softmax ignores a constant per query row
    (q8, qs), (k8, ks), (v8, vs) = quantize_fp8_heads(qt), quantize_fp8_heads(kt), quantize_fp8_heads(vt)
    qk_scale = (qs * ks)[0]  # [H]: batch 1

    def score(score, b, h, q_idx, kv_idx):
        return score * qk_scale[h]

    def fp8_attention():
        return (flex(q8, k8, v8, score_mod=score).float() * vs[..., None, None]).to(torch.bfloat16)

    rows = [x.row("flex bf16", lambda: flex(qt, kt, vt).transpose(1, 2), probe=True),
            x.row("flex fp8 (q, k, v e4m3)", lambda: fp8_attention().transpose(1, 2), probe=True)]
    quantized = getattr(torch.ops.aten, "_scaled_dot_product_attention_quantized", None)
    print(f"aten._scaled_dot_product_attention_quantized (cuDNN FP8 SDPA): {'present' if quantized else 'absent'}"
          f" in torch {torch.__version__}")
    return rows


def sdpa_backend_rows(s: int, heads: int, head_dim: int, repeats: int) -> list[dict[str, str]]:
    """SDPA per backend PyTorch has here, on Q/K/V as the model holds them ([B, S, H, D], passed as
    transposed views) and as contiguous [B, H, S, D]: which one the default picks, and what each costs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, s, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * s * s * heads * head_dim
    layouts = {"BSHD views": tuple(t.transpose(1, 2) for t in (q, k, v)),
               "BHSD contiguous": tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))}
    rows = []
    for layout, (qt, kt, vt) in layouts.items():
        for backend in (None, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            name = "default" if backend is None else backend.name.lower()
            try:
                if backend is None:
                    ms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt), CUDA, repeats)
                else:
                    with sdpa_kernel([backend]):
                        ms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt), CUDA, repeats)
            except RuntimeError as err:
                rows.append({"S": str(s), "kernel": f"sdpa {name} ({layout})", "ms": "-", "TF/s": "-",
                             "vs sdpa": "-", "error": f"unavailable: {str(err)[:60]}"})
                continue
            rows.append({"S": str(s), "kernel": f"sdpa {name} ({layout})", "ms": f"{ms:.3f}",
                         "TF/s": f"{flops / ms / 1e9:.0f}", "vs sdpa": "-", "error": "-"})
    return rows


# Kernel parameters the --configs probe compares: (BLOCK_M, BLOCK_N, warps, stages, TMA, warp specialisation).
PROBE_CONFIGS = ([(128, n, w, st, False, False) for n, w, st in [(64, 8, 3), (64, 8, 4), (128, 8, 2), (128, 8, 3),
                                                                (64, 4, 3)]]
                 + [(128, n, 8, st, True, ws) for ws in (False, True) for n, st in [(64, 3), (128, 2), (128, 3)]])


def config_rows(s: int, heads: int, head_dim: int, repeats: int) -> list[dict[str, str]]:
    """Every operand variant of the flash kernel (INT8 Q.K with per-token scales, FP8 Q.K with per-head
    scales; BF16 or FP8 V) under every PROBE_CONFIGS entry, on operands quantized beforehand: which
    variant and which tiles, TMA or warp specialisation are fastest on this GPU, with each one's error."""
    from ditrun.kernels.attention_triton import flash_attention

    x = Inputs(s, heads, head_dim, repeats)
    q, k, v = x.q, x.k, x.v
    rows = [x.sdpa_row(error=False)]
    int8 = quantize_operands(q, k, v, "bf16")
    fp8_q = quantize_fp8_heads(q.transpose(1, 2))
    fp8_k = quantize_fp8_heads(smooth_k(k, dim=1).transpose(1, 2))
    v_bf16, v_fp8 = v.transpose(1, 2).contiguous(), quantize_v(v.transpose(1, 2), "fp8").contiguous()
    variants = {
        "int8 qk/token, bf16 V": ((int8.q, int8.q_scale, int8.k, int8.k_scale, v_bf16), False),
        "int8 qk/token, fp8 V": ((int8.q, int8.q_scale, int8.k, int8.k_scale, v_fp8), True),
        "fp8 qk/head, bf16 V": ((fp8_q[0], fp8_q[1], fp8_k[0], fp8_k[1], v_bf16), False),
        "fp8 qk/head, fp8 V": ((fp8_q[0], fp8_q[1], fp8_k[0], fp8_k[1], v_fp8), True),
    }
    for name, (operands, fp8_v) in variants.items():
        for bm, bn, warps, stages, tma, ws in PROBE_CONFIGS:
            config = {"BLOCK_M": bm, "BLOCK_N": bn, "TMA": tma, "WARP_SPEC": ws, "num_warps": warps,
                      "num_stages": stages}
            label = f"{name} [{bm}x{bn} w{warps} s{stages}{' tma' if tma else ''}{' ws' if ws else ''}]"
            rows.append(x.row(label, lambda: flash_attention(*operands, 1 / math.sqrt(head_dim), fp8_v,
                                                             config).transpose(1, 2), probe=True))
            print(rows[-1], flush=True)
    return rows


# The Gluon kernel's options the --gluon probe compares (``attention_gluon.int8qk_gluon`` keywords).
GLUON_BEST = dict(block_n=128, stages=4, rowsum_mma=True)
GLUON_CONFIGS = [GLUON_BEST, {**GLUON_BEST, "rowsum_mma": False}, {**GLUON_BEST, "block_n": 64},
                 {**GLUON_BEST, "v_fp8": True}, {**GLUON_BEST, "v_fp8": True, "rowsum_mma": False},
                 {**GLUON_BEST, "v_fp8": True, "stages": 3}, {**GLUON_BEST, "v_fp8": True, "block_n": 64}]


def gluon_label(config: dict) -> str:
    return (f"n{config['block_n']} s{config['stages']}{' rowsum_mma' if config['rowsum_mma'] else ''}"
            f"{' fp8 P.V' if config.get('v_fp8') else ''}")


def gluon_rows(s: int, heads: int, head_dim: int, repeats: int, configs: list[dict]) -> list[dict[str, str]]:
    """The Hopper Gluon INT8-QK kernel (``kernels/attention_gluon.py``) beside the Triton one, on the same
    operands quantized beforehand (BF16 V; FP8-exact V for ``v_fp8`` configurations), per entry of ``configs``
    (``int8qk_gluon`` keywords). Its error column is against fp32 SDPA, as everywhere; each row also prints how
    far it is from the Triton kernel's output on the same operands (the same math, but for FP8 P)."""
    from ditrun.kernels.attention_gluon import int8qk_gluon
    from ditrun.kernels.attention_triton import flash_attention

    x = Inputs(s, heads, head_dim, repeats)
    sm_scale = 1 / math.sqrt(head_dim)
    ops = {v: quantize_operands(x.q, x.k, x.v, v) for v in ("bf16", "fp8")}
    operands = {v: (o.q, o.q_scale, o.k, o.k_scale, o.v, sm_scale) for v, o in ops.items()}
    triton_out = {v: flash_attention(*args) for v, args in operands.items()}
    rows = [x.sdpa_row(),
            x.row("int8qk triton kernel only", lambda: flash_attention(*operands["bf16"]).transpose(1, 2))]
    for config in configs:
        v_format = "fp8" if config.get("v_fp8") else "bf16"

        def run():
            return int8qk_gluon(*operands[v_format], **config)
        try:
            gap = relative_error(run(), triton_out[v_format])
        except Exception as failure:  # noqa: BLE001 - a probe says why it could not run and goes on
            gap = failure_text(failure)
        rows.append(x.row(f"gluon {gluon_label(config)}", lambda: run().transpose(1, 2), probe=True))
        print(rows[-1], f"vs triton: {gap if isinstance(gap, str) else f'{gap:.1e}'}", flush=True)
    return rows


def ncu_calls(s: int, heads: int, head_dim: int) -> None:
    """One SDPA call and two calls of the Gluon kernel (GLUON_BEST; BF16 P @ V, then FP8 P @ V on V's codes),
    nothing timed: the launches for Nsight Compute to compare (``ncu --clock-control none -k
    regex:'sdpa|_int8qk' ...``)."""
    from ditrun.kernels.attention_gluon import int8qk_gluon

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    ops = quantize_operands(q, k, v, "bf16")
    sdpa(q, k, v)
    int8qk_gluon(ops.q, ops.q_scale, ops.k, ops.k_scale, ops.v, 1 / math.sqrt(head_dim), **GLUON_BEST)
    ops = quantize_operands(q, k, v, "fp8")
    codes, v_scale = fp8_v_codes(ops.v)
    int8qk_gluon(ops.q, ops.q_scale, ops.k, ops.k_scale, codes, 1 / math.sqrt(head_dim), v_fp8=True, v_scale=v_scale,
                 **GLUON_BEST)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--s", type=int, nargs="*", default=[20992, 4608])
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5,
                        help="back-to-back calls per timing: each call's host launch overlaps the previous call's GPU "
                             "work, as in a model (1: the launch counts too)")
    parser.add_argument("--flex", action="store_true", help="also FlexAttention in BF16 and FP8 (a probe)")
    parser.add_argument("--sdpa-backends", action="store_true",
                        help="only SDPA per backend and operand layout (which backend is fastest at each S)")
    parser.add_argument("--configs", action="store_true",
                        help="only the flash kernel's operand variants x tile/TMA/warp-specialisation configurations")
    parser.add_argument("--gluon", action="store_true",
                        help="only the Hopper Gluon INT8-QK kernel's configurations beside the Triton kernel")
    parser.add_argument("--gluon-only", metavar="KEY=VALUE,...",
                        help="with --gluon: only this configuration (GLUON_BEST with these keywords changed)")
    parser.add_argument("--fp8-pv", choices=("on", "off"),
                        help="int8qk_fp8v on the Hopper kernel with the FP8 P @ V or not (attention.GLUON_FP8_PV; "
                             "default: as shipped)")
    parser.add_argument("--ncu", action="store_true",
                        help="only one SDPA launch and two of the Gluon kernel, BF16 then FP8 P @ V (for Nsight "
                             "Compute), at the first --s")
    args = parser.parse_args()
    if args.fp8_pv:
        from ditrun.kernels import attention

        attention.GLUON_FP8_PV = args.fp8_pv == "on"
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA/ROCm GPU with Triton")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.heads} heads of {args.head_dim}")
    if args.sdpa_backends:
        print_table([row for s in args.s for row in sdpa_backend_rows(s, args.heads, args.head_dim, args.repeats)])
        return
    if args.configs:
        print_table([row for s in args.s for row in config_rows(s, args.heads, args.head_dim, args.repeats)])
        return
    if args.ncu:
        ncu_calls(args.s[0], args.heads, args.head_dim)
        return
    if args.gluon:
        configs = GLUON_CONFIGS
        if args.gluon_only:
            changes = dict(item.split("=") for item in args.gluon_only.split(","))
            configs = [{**GLUON_BEST, **{key: int(value) for key, value in changes.items()}}]
        print_table([row for s in args.s for row in gluon_rows(s, args.heads, args.head_dim, args.repeats, configs)])
        return
    rows = [row for s in args.s for row in bench(s, args.heads, args.head_dim, args.repeats, args.flex, args.calls)]
    print_table(rows)


if __name__ == "__main__":
    main()
