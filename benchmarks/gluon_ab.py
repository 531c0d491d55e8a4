"""The Hopper INT8-QK kernel against a baseline copy of itself: kernel only, one process, interleaved, beside SDPA.

A change to ``ditrun/kernels/attention_gluon.py`` is measured against the file before it (any copy of the module:
``git show REV:ditrun/kernels/attention_gluon.py > /tmp/base.py``), and against other variants of it, on the
same operands, with both V types
(BF16 P @ V; FP8 P @ V on V's codes made beforehand) and each stage count: rounds of ``--calls`` calls per case,
SDPA's included, the median round reported, so that clock drift hits every case alike; each round starts one case
later (in a fixed order the same code measured up to 7% apart by its place). Outputs are compared with
``torch.equal`` with the first baseline's (a change that keeps the math says "bitwise = base") and against fp32
SDPA over the first 1024 queries. Needs an sm_90 GPU and Triton with Gluon's Hopper API.

    python benchmarks/gluon_ab.py --baseline /tmp/base.py [/tmp/variant.py ...] --s 20992 8704
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ditrun.kernels import attention_gluon as current  # noqa: E402
from ditrun.kernels.attention import quantize_operands  # noqa: E402
from ditrun.kernels.tune import in_turns, load_module, time_ms  # noqa: E402

CUDA = torch.device("cuda")
HEADS, HEAD_DIM, ERROR_QUERIES = 24, 128, 1024


def load_baseline(path: Path):
    return load_module(path, f"attention_gluon_{path.stem}")


def cases(s: int, modules: dict, stages: list[int], configs: list[str]) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """({(V type, stages, a name of ``modules``): a call of that module's kernel on this length's operands}, the
    BF16 q, k, v [1, S, H, D] they were quantized from). Each of ``configs`` (keyword arguments of ``int8qk_gluon``,
    as Python: ``"schedule='stagger'"``) adds a case of the current module."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, HEADS, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    k = k + 0.5 * torch.randn(1, 1, HEADS, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16)
    sm_scale = 1 / math.sqrt(HEAD_DIM)
    made = {}
    for v_type in ("bf16", "fp8"):
        ops = quantize_operands(q, k, v, v_type)
        keywords = {}
        v_operand = ops.v
        if v_type == "fp8":
            v_operand, keywords["v_scale"] = current.fp8_v_operand(ops.v)
        args = (ops.q, ops.q_scale, ops.k, ops.k_scale, v_operand, sm_scale)
        for n in stages:
            for name, module in modules.items():
                made[(v_type, n, name)] = (lambda m=module, a=args, w=keywords, n=n: m.int8qk_gluon(*a, stages=n, **w))
            for config in configs:
                extra = eval(f"dict({config})")  # noqa: S307 (the command line's own keywords)
                made[(v_type, n, f"current[{config}]")] = (
                    lambda a=args, w=keywords | extra, n=n: current.int8qk_gluon(*a, stages=n, **w))
    return made, (q, k, v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, nargs="+", required=True,
                        help="copies of attention_gluon.py to compare with (the first: the bitwise reference)")
    parser.add_argument("--s", type=int, nargs="+", default=[20992, 8704])
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--configs", nargs="*", default=[],
                        help="more cases of the current kernel: int8qk_gluon's keyword arguments, as Python")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gluon_ab.py needs an sm_90 GPU")
    modules = {path.stem: load_baseline(path) for path in args.baseline} | {"current": current}
    reference = args.baseline[0].stem
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {HEADS} heads of {HEAD_DIM}; baselines "
          f"{' '.join(map(str, args.baseline))}", flush=True)
    for s in args.s:
        made, (q, k, v) = cases(s, modules, args.stages, args.configs)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        exact = F.scaled_dot_product_attention(qt.float()[:, :, :ERROR_QUERIES], kt.float(), vt.float())
        times = {key: [] for key in made} | {"sdpa": []}
        calls = list(made.items()) + [("sdpa", lambda: F.scaled_dot_product_attention(qt, kt, vt))]
        for key, fn in in_turns(calls, args.rounds):  # a case's place in a round shows in its time
            times[key].append(time_ms(fn, CUDA, 1, args.calls))  # one round: back to back, primed
        sdpa = statistics.median(times["sdpa"])
        print(f"S={s} sdpa {sdpa:.3f} ms (rounds {' '.join(f'{t:.3f}' for t in times['sdpa'])})", flush=True)
        for key, fn in made.items():
            out, ms = fn(), statistics.median(times[key])
            error = ((out[:, :, :ERROR_QUERIES].float() - exact).abs().max() / exact.abs().max()).item()
            same = ""
            if key[2] != reference:
                same = f"bitwise = {reference}" if torch.equal(out, made[(key[0], key[1], reference)]()) else "differs"
            print(f"  {key[0]} stages {key[1]} {key[2]}: {ms:.3f} ms  {sdpa / ms:.3f}x sdpa  error {error:.1e}  "
                  f"{same}  (rounds {' '.join(f'{t:.3f}' for t in times[key])})", flush=True)


if __name__ == "__main__":
    main()
