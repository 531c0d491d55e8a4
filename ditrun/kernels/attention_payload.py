"""What a quantized attention format sends through a sequence-parallel exchange: codes and scales, not BF16.

With a quantized attention format, each rank of an SP group quantizes its own tokens' Q, K and V before the
all-to-all (``parallel/ulysses.py``) and the receiver attends on the codes as they arrive: no BF16 copy is
exchanged and nothing is quantized twice. The transport moves opaque rows of bytes; this module says what a
row holds (``RowLayout``: one record per token, batch row and head, its fields aligned to 4 bytes) and how to
write and read it. Per token and head, with head dim D (``docs/TRANSPORT.md`` has the bytes per format):

| attention | a row holds |
| --- | --- |
| ``int8qk`` | Q, K: INT8 codes + an fp32 scale each; V in the model dtype |
| ``int8qk_fp8v`` | Q, K as above; V's E4M3 codes (the scale per head comes from the statistics) |
| ``int8qk_mxfp6v`` | Q, K as above; V's FP6 E2M3 codes packed 4 in 3 bytes + an E8M0 scale per 32 channels |
| ``fp8_pv`` | Q, K, V: E4M3 codes (the scales per call come from the statistics) |

A quantizer's statistics that span tokens — K's mean (the smoothing of every format), V's amax per head
(``int8qk_fp8v``), each tensor's amax per call (``fp8_pv``) — are the whole sequence's: every rank's
``Statistics`` (its K token sums in fp64 and its amaxes, per batch row and head, [B, H, D + 3]) are gathered
over the SP group before the first exchange and combined alike on every rank (``token_statistics.py``). So the
codes and scales are bit for bit those a receiver would make quantizing after a BF16 exchange: the outputs equal
that path's (``tests/test_quantized_exchange.py``), whatever the split.

"Per call" (``fp8_pv``): a head group's heads are split into one call per destination rank, in the order
``UlyssesAttention`` sends them, and a call's scale is the amax over its heads and batch rows, as the receiver's
own ``fp8_pv_operands`` would find.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ditrun.kernels import formats
from ditrun.kernels.attention import V_FORMATS, Int8QK, attend_int8qk, gluon_key_order, quantize_int8_rows, smooth_k
from ditrun.kernels.fp8_sdpa import attend_fp8_pv, fp8_pv_codes, fp8_pv_scales
from ditrun.kernels.linear import triton_available
from ditrun.kernels.token_statistics import token_amax, token_mean, token_sum
from ditrun.registry import Registry

FIELD_ALIGN = 4
"""Bytes each field of a row starts at a multiple of (its fp32 scales are read in place)."""


@dataclass(frozen=True)
class Statistics:
    """What a quantizer needs from every token, per batch row and head: K's token sums and max |Q|, |K|, |V|."""

    k_sum: torch.Tensor
    """[B, H, D] fp64."""
    amax: torch.Tensor
    """[B, H, 3] fp64: |Q|, |K|, |V|."""
    tokens: int
    """Tokens the sums are over."""

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> "Statistics":
        """This rank's share: q, k, v [B, L, H, D] (L may be 0)."""
        amax = torch.stack([token_amax(t, (1, 3)) for t in (q, k, v)], dim=-1)
        return cls(token_sum(k, 1), amax, q.shape[1])

    def packed(self) -> torch.Tensor:
        """-> [1, B * H * (D + 3)] fp64: one row for a gather."""
        return torch.cat([self.k_sum, self.amax], dim=-1).flatten()[None]

    @classmethod
    def combined(cls, rows: torch.Tensor, batch: int, heads: int, tokens: int) -> "Statistics":
        """Every rank's ``packed`` rows [P, n] -> the whole sequence's (sums summed, maxima taken)."""
        per_rank = rows.view(rows.shape[0], batch, heads, -1)
        return cls(per_rank[..., :-3].sum(dim=0), per_rank[..., -3:].amax(dim=0), tokens)

    def heads(self, first: int, count: int) -> "Statistics":
        return Statistics(self.k_sum[:, first : first + count], self.amax[:, first : first + count], self.tokens)


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    width: int
    """Elements per (token, batch row, head)."""

    @property
    def nbytes(self) -> int:
        return self.width * torch.empty((), dtype=self.dtype).element_size()


def _aligned(n: int) -> int:
    return -(-n // FIELD_ALIGN) * FIELD_ALIGN


@dataclass(frozen=True)
class RowLayout:
    """Where each field sits in one (token, batch row, head) record of bytes."""

    fields: tuple[Field, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        starts, at = [], 0
        for f in self.fields:
            starts.append(at)
            at = _aligned(at + f.nbytes)
        return tuple(starts)

    @property
    def nbytes(self) -> int:
        last = self.fields[-1]
        return _aligned(self.offsets[-1] + last.nbytes)

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """rows: uint8 [..., nbytes] -> each field in place, [..., width] of its dtype."""
        return {
            f.name: rows[..., at : at + f.nbytes].view(f.dtype) for f, at in zip(self.fields, self.offsets, strict=True)
        }


class Payload(Protocol):
    name: str

    def layout(self, head_dim: int, dtype: torch.dtype) -> RowLayout:
        """The record of one (token, batch row, head) for a model of this head dim and compute dtype."""

    def encode(self, q, k, v, stats: Statistics, calls: int) -> dict[str, torch.Tensor]:
        """q, k, v [B, L, H, D] (this rank's tokens, the heads of ``stats``, ``calls`` attention calls of H / calls
        heads each) -> each field [B, L, H, width]."""

    def attend(self, fields: dict[str, torch.Tensor], stats: Statistics, dtype: torch.dtype) -> torch.Tensor:
        """The received fields [B, S, Hc, width] of one call's heads (``stats``: theirs) -> [B, S, Hc, D]."""


def mx_rows(v: torch.Tensor, element: str, by_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``formats.quantize_mx(v, element)`` of v [B, L, H, D] (a head slice of a [B, L, H_all, D] tensor too):
    (packed codes [B, L, H, D * bits / 8], E8M0 scales [B, L, H, D / 32]); ``by_kernel``: in one Triton pass
    (``mx_gemm_triton.mx_quantize`` over the [B * L, H * D] rows; every block and packed group lies inside a head)."""
    if not by_kernel:
        return formats.quantize_mx(v, element)
    from ditrun.kernels.mx_gemm_triton import mx_quantize

    b, length, h, d = v.shape
    codes, scales = mx_quantize(v.reshape(b * length, h * d), element)
    return codes.view(b, length, h, -1), scales.view(b, length, h, -1)


def _codes_as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


class Int8QKPayload:
    """INT8 Q and smoothed K with a scale per token and head; V in its format (``attention.int8qk_attention``).

    On a GPU its Q and K codes are written by the fused producer (``qk_producer_triton``: RMSNorm + RoPE + INT8 in
    one kernel) straight from the projections into the send slot (``statistics_from_raw``, ``write_qk``); elsewhere
    ``encode`` quantizes the normalized, rotated Q and K."""

    produces_qk = True
    """Its Q and K codes can be written from the projections by the fused producer (``write_qk``)."""

    def __init__(self, name: str, v_format: str, implementation: str):
        self.name, self.v_format, self.implementation = name, v_format, implementation

    def layout(self, head_dim: int, dtype: torch.dtype) -> RowLayout:
        qk = [Field("q", torch.int8, head_dim), Field("q_scale", torch.float32, 1)]
        qk += [Field("k", torch.int8, head_dim), Field("k_scale", torch.float32, 1)]
        if self.v_format == "bf16":
            return RowLayout((*qk, Field("v", dtype, head_dim)))
        if self.v_format == "fp8":
            return RowLayout((*qk, Field("v", torch.uint8, head_dim)))
        fp6 = Field("v", torch.uint8, head_dim * 3 // 4)  # four codes in three bytes
        return RowLayout((*qk, fp6, Field("v_scale", torch.uint8, head_dim // 32)))

    def encode(self, q, k, v, stats: Statistics, calls: int) -> dict[str, torch.Tensor]:
        # q, k, v: [B, L, H, D] -> fields [B, L, H, width]
        mean = token_mean(stats.k_sum, stats.tokens, k.dtype)[:, None]  # [B, 1, H, D], as smooth_k's
        q8, q_scale = quantize_int8_rows(q)  # per token and head: the layout does not matter
        k8, k_scale = quantize_int8_rows(smooth_k(k, 1, mean))
        return {
            "q": q8,
            "q_scale": q_scale[..., None],
            "k": k8,
            "k_scale": k_scale[..., None],
            **self.encode_v(v, stats),
        }

    def encode_v(self, v, stats: Statistics) -> dict[str, torch.Tensor]:
        """V's fields: v [B, L, H, D] -> [B, L, H, width] each."""
        if self.v_format == "bf16":
            return {"v": v}
        if self.v_format == "fp8":
            scaled = torch.ldexp(v.float(), -self._v_exponents(stats)[:, None, :, None])
            return {"v": _codes_as_bytes(formats.round_to_grid(scaled, "fp8_e4m3").to(torch.float8_e4m3fn))}
        codes, scales = mx_rows(v, "fp6_e2m3", triton_available(v.device))  # blocks along each token's channels
        return {"v": codes, "v_scale": scales}

    @staticmethod
    def statistics_from_raw(q, k, v, norms, rope) -> Statistics:
        """This rank's share from Q and K as projected (the GPU's fused producer): K's sums and amax of its
        normalized, rotated values by ``qk_producer_triton.norm_rope_statistics``; V's amax. Q's amax, which no
        INT8 payload reads, is not measured (nan)."""
        from ditrun.kernels.qk_producer_triton import norm_rope_statistics

        b, length, h, d = k.shape
        k_sum = torch.zeros(b, h, d, dtype=torch.float64, device=k.device)
        k_amax = torch.zeros(b, h, dtype=torch.float32, device=k.device)
        cos, sin = rope
        for at, _, weight in norms.spans(length):
            part_sum, part_amax = norm_rope_statistics(k[:, at], weight, cos[at], sin[at], norms.eps)
            k_sum += part_sum
            k_amax = torch.maximum(k_amax, part_amax)
        q_amax = torch.full_like(k_sum[..., 0], float("nan"))
        return Statistics(k_sum, torch.stack([q_amax, k_amax.double(), token_amax(v, (1, 3))], dim=-1), length)

    @staticmethod
    def write_qk(q, k, norms, rope, k_mean, fields: dict[str, torch.Tensor]) -> None:
        """Q and K as projected ([B, L, H, D]) -> their codes and scales written into ``fields`` ([B, L, P, H/P, w]
        views of the send slot) by the fused producer: RMSNorm (``norms``), RoPE (``rope``), K minus ``k_mean``
        ([B, H, D] in K's dtype), INT8 per token and head."""
        from ditrun.kernels.qk_producer_triton import norm_rope_quantize

        cos, sin = rope
        for at, q_weight, k_weight in norms.spans(q.shape[1]):
            for name, x, weight, mean in (("q", q, q_weight, None), ("k", k, k_weight, k_mean)):
                codes, scale = fields[name][:, at], fields[f"{name}_scale"][:, at, ..., 0]
                norm_rope_quantize(x[:, at], weight, cos[at], sin[at], codes, scale, mean, norms.eps)

    def _v_exponents(self, stats: Statistics) -> torch.Tensor:
        """The power-of-two exponent of V's E4M3 scale per (batch row, head), [B, H] fp32 (``fp8_head_exponents``)."""
        amax = stats.amax[..., 2].float()  # exact: an fp32 or BF16 value
        return formats.shared_exponents(amax, formats.FORMATS["fp8_e4m3"], "rceil").float()

    def attend(self, fields: dict[str, torch.Tensor], stats: Statistics, dtype: torch.dtype) -> torch.Tensor:
        # fields: [B, S, Hc, width] -> [B, S, Hc, D]
        def heads_major(t: torch.Tensor) -> torch.Tensor:  # [B, S, Hc, ...] -> [B, Hc, S, ...]
            return t.transpose(1, 2).contiguous()

        q, k = heads_major(fields["q"]), heads_major(fields["k"])
        q_scale, k_scale = (heads_major(fields[n][..., 0]) for n in ("q_scale", "k_scale"))
        if self.v_format == "bf16":
            return attend_int8qk(Int8QK(q, q_scale, k, k_scale, heads_major(fields["v"])), self.implementation)
        if self.v_format == "mxfp6":
            v = formats.dequantize_mx(fields["v"], fields["v_scale"], "fp6_e2m3").to(dtype)
            return attend_int8qk(Int8QK(q, q_scale, k, k_scale, heads_major(v)), self.implementation)
        exponent = self._v_exponents(stats)  # [B, Hc]
        codes = heads_major(fields["v"])  # [B, Hc, S, D] E4M3 bytes
        if self.implementation == "gluon" and dtype == torch.bfloat16:  # its FP8 P @ V reads the codes
            v_scale = torch.ldexp(torch.ones_like(exponent), exponent).flatten()
            v = gluon_key_order(codes).view(torch.float8_e4m3fn)
            return attend_int8qk(Int8QK(q, q_scale, k, k_scale, v, v_scale), self.implementation)
        v = torch.ldexp(codes.view(torch.float8_e4m3fn).float(), exponent[..., None, None]).to(dtype)
        return attend_int8qk(Int8QK(q, q_scale, k, k_scale, v), self.implementation)


class Fp8PvPayload:
    """Q, smoothed K and V as E4M3 codes with one power-of-two scale per call (``fp8_sdpa.py``)."""

    name = "fp8_pv"

    def __init__(self, implementation: str):
        self.implementation = implementation

    def layout(self, head_dim: int, dtype: torch.dtype) -> RowLayout:
        return RowLayout(tuple(Field(n, torch.uint8, head_dim) for n in ("q", "k", "v")))

    @staticmethod
    def call_scales(stats: Statistics, calls: int) -> torch.Tensor:
        """The four scales of ``fp8_pv_operands`` for each call, [calls, 4] fp32, as the call's receiver finds them."""
        b, h, _ = stats.amax.shape
        amax = stats.amax.view(b, calls, h // calls, 3).amax(dim=(0, 2)).float()  # [calls, 3]
        mean = token_mean(stats.k_sum, stats.tokens, torch.float32).abs()  # [B, H, D]
        mean_amax = mean.view(b, calls, h // calls, -1).amax(dim=(0, 2, 3))
        return fp8_pv_scales(amax[:, 0], amax[:, 1], mean_amax, amax[:, 2])

    def encode(self, q, k, v, stats: Statistics, calls: int) -> dict[str, torch.Tensor]:
        # q, k, v: [B, L, H, D] -> E4M3 bytes [B, L, H, D]
        mean = token_mean(stats.k_sum, stats.tokens, torch.float32)[:, None]  # [B, 1, H, D]
        per_head = self.call_scales(stats, calls).repeat_interleave(q.shape[2] // calls, dim=0)  # [H, 4]
        codes = fp8_pv_codes(q, k, v, mean, *(per_head[:, i, None] for i in range(3)))
        return {n: _codes_as_bytes(c) for n, c in zip(("q", "k", "v"), codes, strict=True)}

    def attend(self, fields: dict[str, torch.Tensor], stats: Statistics, dtype: torch.dtype) -> torch.Tensor:
        q8, k8, v8 = (fields[n].view(torch.float8_e4m3fn) for n in ("q", "k", "v"))
        return attend_fp8_pv(q8, k8, v8, self.call_scales(stats, 1)[0], self.implementation, dtype)


PAYLOADS: Registry[Callable[[str], Payload]] = Registry("quantized exchange payload", "precision.attention")
"""Attention kernel name -> (implementation -> its payload): the kernels whose operands cross an exchange as codes."""
PAYLOADS.register("fp8_pv", Fp8PvPayload)
for _v in V_FORMATS:
    _name = "int8qk" if _v == "bf16" else f"int8qk_{_v}v"
    PAYLOADS.register(_name, lambda implementation, _name=_name, _v=_v: Int8QKPayload(_name, _v, implementation))


def payload_for(attention: str, implementation: str):
    """The payload of attention kernel ``attention`` run by ``implementation``, or None (an unquantized kernel
    exchanges its operands as they are)."""
    return PAYLOADS.get(attention)(implementation) if attention in PAYLOADS else None
