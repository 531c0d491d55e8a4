"""The quantized exchange's Q/K producer on one GPU: the fused Triton kernel against the unfused sequence.

    python benchmarks/qk_producer.py                     # 20992 tokens, 24 heads of 128, P = 2, 4, 8 shards
    python benchmarks/qk_producer.py --s 20992 --shards 2 4 8 --repeats 20

One rank of an SP group of P holds S / P tokens of every head. From the projections' output (x: [1, S/P, 24, 128]
BF16, per head) to Q's and K's INT8 codes and fp32 scales in the qkv exchange's send rows (``RowLayout``'s field
views, destination-major as ``UlyssesAttention`` writes them), each row of the table times:

* ``bf16 producer`` (the ceiling's peer: today's exchange): RMSNorm + RoPE in torch, then the BF16 Q and K copied into
  a BF16 send slot; what the quantized exchange replaces;
* ``unfused eager``: RMSNorm + RoPE, K's statistics (fp64 sums) and smoothing, ``quantize_int8_rows`` and the copies
  into the byte slot's fields, in eager torch (the CPU path's composition);
* ``unfused compiled``: the same function through ``torch.compile``;
* ``fused``: ``qk_producer_triton``: the statistics pass over K, then one kernel per stream that normalizes, rotates,
  quantizes and stores into the slot.

ms per call (median, ``timing.time_ms``) of Q and K together; the statistics' gather between the passes is not
included (a collective over the SP group, the same for every producer but the BF16 one). Last column: bytes the
producer wrote into its send slot.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from harness import print_table, time_ms

from ditrun.kernels.attention import quantize_int8_rows, smooth_k
from ditrun.kernels.attention_payload import Field, RowLayout
from ditrun.kernels.token_statistics import token_mean, token_sum
from ditrun.model.dit import apply_rope, rope_tables


def inputs(tokens: int, heads: int, head_dim: int):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = [torch.randn(1, tokens, heads, head_dim, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    weight = [1 + 0.1 * torch.randn(head_dim, device="cuda", generator=g) for _ in range(2)]
    side = int(tokens**0.5) + 1
    ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // side, torch.arange(tokens) % side], dim=1)
    cos, sin = rope_tables(ids.cuda(), (16, 56, 56))
    return x, [w.to(torch.bfloat16) for w in weight], cos, sin


LAYOUT = RowLayout(
    (Field("q", torch.int8, 128), Field("q_scale", torch.float32, 1))
    + (Field("k", torch.int8, 128), Field("k_scale", torch.float32, 1))
)


def slot_fields(slot: torch.Tensor, shards: int) -> dict[str, torch.Tensor]:
    """The send slot [P * L, 1, H/P, record] bytes as fields [1, L, H, w] of this rank's tokens, destination-major."""
    views = LAYOUT.views(slot.view(shards, -1, *slot.shape[1:]))  # [P, L, 1, H/P, w]
    return {n: t.permute(2, 1, 0, 3, 4).flatten(2, 3) for n, t in views.items()}


def unfused(x, weight, cos, sin, fields) -> None:
    normed = [apply_rope(F.rms_norm(t, (t.shape[-1],), w, eps=1e-6), cos, sin) for t, w in zip(x, weight)]
    q, k = normed
    mean = token_mean(token_sum(k, 1), k.shape[1], k.dtype)[:, None]
    for name, t in (("q", q), ("k", smooth_k(k, 1, mean))):
        codes, scale = quantize_int8_rows(t)
        fields[name].copy_(codes)
        fields[f"{name}_scale"][..., 0].copy_(scale)


def fused(x, weight, cos, sin, fields, **launch) -> None:
    from ditrun.kernels.qk_producer_triton import norm_rope_quantize, norm_rope_statistics

    k_sum, _ = norm_rope_statistics(x[1], weight[1], cos, sin, **launch)
    mean = token_mean(k_sum, x[1].shape[1], x[1].dtype)
    norm_rope_quantize(x[0], weight[0], cos, sin, fields["q"], fields["q_scale"][..., 0], **launch)
    norm_rope_quantize(x[1], weight[1], cos, sin, fields["k"], fields["k_scale"][..., 0], mean, **launch)


LAUNCHES = [(block, warps) for block in (8, 16, 32, 64) for warps in (1, 2, 4, 8)]
"""``--tune``: the fused producer's (tokens per program, warps) tried."""


def tune_row(s: int, shards: int, heads: int, repeats: int) -> dict[str, str]:
    """ms of the fused producer per (block_l, num_warps) at one P; the kernels' defaults marked."""
    from ditrun.kernels.qk_producer_triton import BLOCK_L, WARPS

    tokens = s // shards
    x, weight, cos, sin = inputs(tokens, heads, 128)
    slot = torch.empty(shards * tokens, 1, heads // shards, LAYOUT.nbytes, dtype=torch.uint8, device="cuda")
    fields = slot_fields(slot, shards)
    cuda = torch.device("cuda")
    row = {"P": str(shards)}
    for block, warps in LAUNCHES:
        ms = time_ms(lambda: fused(x, weight, cos, sin, fields, block_l=block, num_warps=warps), cuda, repeats)
        row[f"{block}/{warps}" + ("*" if (block, warps) == (BLOCK_L, WARPS) else "")] = f"{ms:.3f}"
    return row


def bf16_producer(x, weight, cos, sin, slot) -> None:
    # slot: [P, L, 2, 1, H/P, D] BF16 (today's qkv rows without V)
    for i, (t, w) in enumerate(zip(x, weight)):
        y = apply_rope(F.rms_norm(t, (t.shape[-1],), w, eps=1e-6), cos, sin)
        slot[:, :, i].copy_(y.unflatten(2, (slot.shape[0], -1)).permute(2, 1, 0, 3, 4))


def row(s: int, shards: int, heads: int, repeats: int) -> dict[str, str]:
    tokens = s // shards
    x, weight, cos, sin = inputs(tokens, heads, 128)
    slot = torch.empty(shards * tokens, 1, heads // shards, LAYOUT.nbytes, dtype=torch.uint8, device="cuda")
    fields = slot_fields(slot, shards)
    bf16_slot = torch.empty(shards, tokens, 2, 1, heads // shards, 128, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(unfused)
    cuda = torch.device("cuda")
    times = {
        "bf16 producer": time_ms(lambda: bf16_producer(x, weight, cos, sin, bf16_slot), cuda, repeats),
        "unfused eager": time_ms(lambda: unfused(x, weight, cos, sin, fields), cuda, repeats),
        "unfused compiled": time_ms(lambda: compiled(x, weight, cos, sin, fields), cuda, repeats),
        "fused": time_ms(lambda: fused(x, weight, cos, sin, fields), cuda, repeats),
    }
    # the fused producer writes the unfused one's codes but for rounding-boundary ties (tests/test_qk_producer.py)
    fused(x, weight, cos, sin, fields)
    got = {n: t.clone() for n, t in fields.items()}
    unfused(x, weight, cos, sin, fields)
    differ = sum(int((got[n].int() - fields[n].int()).abs().gt(1).sum()) for n in ("q", "k"))
    return {
        "P": str(shards),
        "tokens/rank": str(tokens),
        **{name: f"{ms:.3f}" for name, ms in times.items()},
        "fused vs eager": f"{times['unfused eager'] / times['fused']:.2f}x",
        "codes off by >1": str(differ),
        "slot bytes (int8 / bf16)": f"{slot.numel()} / {bf16_slot.numel() * 2}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--s", type=int, default=20992, help="tokens of the whole sequence")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--shards", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tune", action="store_true", help="also time the fused producer per (block_l, warps)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("qk_producer.py needs a GPU (the fused producer is a Triton kernel).")
    print(f"{torch.cuda.get_device_name()}: S = {args.s}, {args.heads} heads of 128, ms per call (Q and K)")
    print_table([row(args.s, p, args.heads, args.repeats) for p in args.shards])
    if args.tune:
        print("fused producer, ms per call by tokens per program / warps (* the kernels' default):")
        print_table([tune_row(args.s, p, args.heads, args.repeats) for p in args.shards])


if __name__ == "__main__":
    main()
