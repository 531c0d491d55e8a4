"""Ulysses sequence parallelism: shard the joint sequence, exchange sequence shards for head shards.

Each rank of the SP group holds a slice of every part of the joint sequence — text tokens,
output-image tokens and reference-image tokens — and runs the DiT on those slices only: every
layer but attention works token by token, and the rotary tables follow the tokens through
their position ids. Around attention, one all-to-all turns a rank's [B, L_r, H, D] (its own
tokens, all heads) into [B, S, H/P, D] (every token, its heads) and a second one turns the
output back. Lengths that P does not divide are split unevenly (``all_to_all_single`` takes
per-peer row counts), so no padding or key mask is needed.

With a quantized attention format (``payload``, ``kernels/attention_payload.py``) the first exchange carries
codes and scales instead: each rank quantizes its own tokens (with the whole sequence's statistics, gathered
first: a [B, H, D + 3] fp64 row per rank) into the transport's send slot, and the receiver attends on the codes
as they landed. The attention output travels back in the model dtype either way. An INT8 Q/K payload takes Q
and K as projected (``takes_raw_qk``; the block hands its per-head norms, ``dit.QKNorms``): on a GPU the fused
producer (``kernels/qk_producer_triton.py``) normalizes, rotates and quantizes them into the send slot in one
pass, with no BF16 Q or K in between; elsewhere they are normalized and rotated as the block would have done.

Gathered, the sequence is ordered by rank ([text_0, out_0, ref_0, text_1, ...]) rather than as
on one process; attention without a mask does not depend on the order of the keys except
through the order of floating-point sums, which is why results match one process to rounding
rather than bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ditrun.kernels.attention_payload import Payload, Statistics
from ditrun.kernels.linear import triton_available
from ditrun.kernels.sdpa import AttentionFn, sdpa_attention
from ditrun.kernels.token_statistics import token_mean
from ditrun.model.sampler import EditInputs
from ditrun.transport.base import ExchangeShape, Handle, Transport, all_gather_rows, gather_shape

STATISTICS = "attention_statistics"
"""The exchange kind of a quantized exchange's statistics (every rank's, gathered before the first Q/K/V)."""


def even_splits(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` ranks, the first ``n % parts`` ranks taking one more."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _bounds(sizes: list[int], index: int) -> tuple[int, int]:
    start = sum(sizes[:index])
    return start, start + sizes[index]


@dataclass(frozen=True)
class SequenceShards:
    """How one edit's joint sequence is split over an SP group, and which part is this rank's."""

    text: list[int]
    output: list[int]
    reference: list[int]
    rank: int

    @classmethod
    def split(cls, text_len: int, output_len: int, reference_len: int, size: int, rank: int) -> "SequenceShards":
        return cls(even_splits(text_len, size), even_splits(output_len, size), even_splits(reference_len, size), rank)

    @property
    def joint(self) -> list[int]:
        """Tokens per rank in a forward pass (text + output + reference)."""
        return [t + o + r for t, o, r in zip(self.text, self.output, self.reference)]

    def output_slice(self) -> slice:
        return slice(*_bounds(self.output, self.rank))

    def local_inputs(self, inputs: EditInputs) -> EditInputs:
        """The rank's slice of every per-token input (the noise is sliced per step, by ``output_slice``)."""
        text = slice(*_bounds(self.text, self.rank))
        ref = slice(*_bounds(self.reference, self.rank))
        out = self.output_slice()
        return dataclasses.replace(
            inputs,
            noise=inputs.noise[:, out],
            ref_latents=inputs.ref_latents[:, ref],
            img_ids=inputs.img_ids[out],
            ref_ids=inputs.ref_ids[ref],
            prompt=inputs.prompt[:, text],
            neg_prompt=None if inputs.neg_prompt is None else inputs.neg_prompt[:, text],
            txt_ids=inputs.txt_ids[text],
        )

    def gather_output(self, transport: Transport, local: torch.Tensor, kind: str = "velocity_gather") -> torch.Tensor:
        """Every rank's output-token rows, in sequence order. local: [B, O_r, C] -> [B, O, C]."""
        rows = local.transpose(0, 1)  # [O_r, B, C]: rows are tokens
        return all_gather_rows(transport, rows, self.output, kind).transpose(0, 1)


def attention_shapes(
    joint: list[int],
    batch: int,
    heads: int,
    head_dim: int,
    head_groups: int,
    dtype: torch.dtype,
    payload: Optional[Payload] = None,
) -> tuple[ExchangeShape, ...]:
    """The exchanges of Ulysses attention over an SP group whose ranks hold ``joint[i]`` tokens.

    qkv: rank i sends its joint[i] tokens of each destination's heads to every rank, rows
    [3, B, H/(PG), D] (with a ``payload``: bytes [B, H/(PG), record], its ``RowLayout``); attention_out: rank i
    sends rank j's joint[j] tokens back, rows [B, H/(PG), D]. With a payload, the statistics' gather comes last.
    """
    p = len(joint)
    per_rank = heads // (p * head_groups)
    counts = tuple((n,) * p for n in joint)
    if payload is None:
        qkv = ExchangeShape("qkv", counts, (3, batch, per_rank, head_dim), dtype, head_groups)
    else:
        record = payload.layout(head_dim, dtype).nbytes
        qkv = ExchangeShape("qkv", counts, (batch, per_rank, record), torch.uint8, head_groups)
    out = ExchangeShape("attention_out", (tuple(joint),) * p, (batch, per_rank, head_dim), dtype, head_groups)
    if payload is None:
        return qkv, out
    return qkv, out, gather_shape(STATISTICS, [1] * p, (batch * heads * (head_dim + 3),), torch.float64)


class UlyssesAttention:
    """An ``attention(q, k, v)`` for ``FluxDiT.forward`` that runs over an SP group.

    With ``head_groups=G`` the heads are exchanged and attended in G groups: group g+1's
    exchange is started before group g's attention, and each group's output is sent back as
    soon as its attention ends, so exchanges overlap computation.
    """

    def __init__(
        self,
        transport: Transport,
        joint_splits: list[int],
        head_groups: int = 1,
        inner: AttentionFn = sdpa_attention,
        payload: Optional[Payload] = None,
        raw_qk: bool = True,
    ):
        self.transport, self.splits, self.head_groups, self.inner = transport, joint_splits, head_groups, inner
        self.payload = payload
        """Set: Q, K and V cross the exchange as this format's codes (``inner`` is then not called)."""
        self.takes_raw_qk = raw_qk and transport.size > 1 and getattr(payload, "produces_qk", False)
        """The block calls ``from_raw`` with Q and K as projected (``dit.Regions.run``)."""

    def shapes(self, q: torch.Tensor) -> tuple[ExchangeShape, ...]:
        """The (qkv, attention_out[, statistics]) shapes for queries shaped like ``q`` ([B, L_r, H, D])."""
        b, _, h, d = q.shape
        return attention_shapes(self.splits, b, h, d, self.head_groups, q.dtype, self.payload)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [B, L_r, H, D] (this rank's tokens, every head) -> [B, L_r, H, D]
        if self.transport.size == 1:
            return self._local(q, k, v)
        qkv_shape = self.shapes(q)[0]
        if self.payload is None:
            return self._exchange(q, functools.partial(self._send_qkv, q, k, v, shape=qkv_shape), self._attend_values)
        stats = self._statistics(Statistics.of(q, k, v), q)
        send = functools.partial(self._send_codes, q, k, v, stats, shape=qkv_shape)
        return self._exchange(q, send, functools.partial(self._attend_codes, stats, q))

    def from_raw(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norms, rope) -> torch.Tensor:
        """As a call, with Q and K as projected (``takes_raw_qk``): ``norms`` (``dit.QKNorms``) and ``rope`` (cos,
        sin [L_r, D]) say how the block would have normalized and rotated them."""
        if not triton_available(q.device):  # the composition: what the block would have handed a call
            return self(*norms.apply(q, k, rope), v)
        stats = self._statistics(self.payload.statistics_from_raw(q, k, v, norms, rope), q)
        send = functools.partial(self._send_raw, q, k, v, norms, rope, stats, shape=self.shapes(q)[0])
        return self._exchange(q, send, functools.partial(self._attend_codes, stats, q))

    def _exchange(self, q: torch.Tensor, send, attend) -> torch.Tensor:
        # send(g) starts head group g's exchange; attend(received, g) -> [B, S, H/(PG), D]
        out_shape = self.shapes(q)[1]
        out = torch.empty_like(q)
        incoming = [send(0)]
        outgoing: list[Handle] = []
        for g in range(self.head_groups):
            if g + 1 < self.head_groups:
                incoming.append(send(g + 1))
            attended = attend(incoming[g].wait(), g)  # [B, S, H/(PG), D]
            incoming[g].release()  # attention is queued: the slot may take the next exchange
            incoming[g] = None
            # Sent back at once, so that it travels while the next group's attention runs.
            outgoing.append(self._send_back(attended, g, out_shape))
        for g, handle in enumerate(outgoing):
            self._place(out, handle.wait(), g)
            handle.release()
        return out

    def _local(self, q, k, v) -> torch.Tensor:
        # An SP group of one: no exchange; head groups only split the attention call.
        if self.head_groups == 1:
            return self.inner(q, k, v)
        return torch.cat(
            [self.inner(*parts) for parts in zip(*(t.chunk(self.head_groups, dim=2) for t in (q, k, v)))], dim=2
        )

    def _group_heads(self, x: torch.Tensor, g: int) -> torch.Tensor:
        # [B, L, H, D] -> [B, L, P, H/(PG), D]: group g's heads, split by destination rank
        per_group = x.shape[2] // self.head_groups
        return x[:, :, g * per_group : (g + 1) * per_group].unflatten(2, (self.transport.size, -1))

    def _send_qkv(self, q, k, v, g: int, shape: ExchangeShape) -> Handle:
        # -> send: [P * L_r, 3, B, H/(PG), D], the rows for destination rank j contiguous, written
        # straight into the transport's send slot
        send = self.transport.send_buffer(shape, g)
        blocks = send.view(self.transport.size, q.shape[1], *shape.row_shape)  # [P, L_r, 3, B, H/(PG), D]
        for i, t in enumerate((q, k, v)):
            blocks[:, :, i].copy_(self._group_heads(t, g).permute(2, 1, 0, 3, 4))
        return self.transport.start(send, shape, g)

    def _attend_values(self, qkv: torch.Tensor, g: int) -> torch.Tensor:
        # qkv: [S, 3, B, H/(PG), D] -> [B, S, H/(PG), D]
        return self.inner(*(qkv[:, i].transpose(0, 1) for i in range(3)))

    def _statistics(self, own: Statistics, q: torch.Tensor) -> Statistics:
        """The whole sequence's statistics, the same on every rank: each rank's row gathered, combined alike."""
        rows = all_gather_rows(self.transport, own.packed(), [1] * self.transport.size, STATISTICS)
        return Statistics.combined(rows, q.shape[0], q.shape[2], sum(self.splits))

    def _send_codes(self, q, k, v, stats: Statistics, g: int, shape: ExchangeShape) -> Handle:
        # q, k, v: [B, L_r, H, D] -> send: [P * L_r, B, H/(PG), record] bytes, the rows for destination j
        # contiguous: group g's codes written straight into the transport's send slot
        p, per_group = self.transport.size, q.shape[2] // self.head_groups
        heads = slice(g * per_group, (g + 1) * per_group)
        fields = self.payload.encode(
            q[:, :, heads], k[:, :, heads], v[:, :, heads], stats.heads(heads.start, per_group), p
        )
        send = self.transport.send_buffer(shape, g)
        slots = self.payload.layout(q.shape[3], q.dtype).views(send.view(p, q.shape[1], *shape.row_shape))
        for name, codes in fields.items():  # [B, L_r, H/G, w] -> [P, L_r, B, H/(PG), w]
            slots[name].copy_(codes.unflatten(2, (p, -1)).permute(2, 1, 0, 3, 4))
        return self.transport.start(send, shape, g)

    def _send_raw(self, q, k, v, norms, rope, stats: Statistics, g: int, shape: ExchangeShape) -> Handle:
        # q, k as projected, v: [B, L_r, H, D] -> the send slot as ``_send_codes`` fills it, Q and K written by the
        # fused producer straight into their fields
        p, per_group = self.transport.size, q.shape[2] // self.head_groups
        heads = slice(g * per_group, (g + 1) * per_group)
        send = self.transport.send_buffer(shape, g)
        slots = self.payload.layout(q.shape[3], q.dtype).views(send.view(p, q.shape[1], *shape.row_shape))
        fields = {name: t.permute(2, 1, 0, 3, 4) for name, t in slots.items()}  # [B, L_r, P, H/(PG), w]
        k_mean = token_mean(stats.k_sum[:, heads], stats.tokens, k.dtype)  # [B, H/G, D], as smooth_k's
        self.payload.write_qk(q[:, :, heads], k[:, :, heads], norms, rope, k_mean, fields)
        for name, codes in self.payload.encode_v(v[:, :, heads], stats.heads(heads.start, per_group)).items():
            fields[name].copy_(codes.unflatten(2, (p, -1)))
        return self.transport.start(send, shape, g)

    def _attend_codes(self, stats: Statistics, q: torch.Tensor, received: torch.Tensor, g: int) -> torch.Tensor:
        # received: [S, B, H/(PG), record] bytes -> [B, S, H/(PG), D]: this rank's heads of group g
        per_rank = q.shape[2] // (self.head_groups * self.transport.size)
        first = (g * self.transport.size + self.transport.rank) * per_rank
        fields = self.payload.layout(q.shape[3], q.dtype).views(received)
        received_fields = {name: t.transpose(0, 1) for name, t in fields.items()}
        return self.payload.attend(received_fields, stats.heads(first, per_rank), q.dtype)

    def _send_back(self, attended: torch.Tensor, g: int, shape: ExchangeShape) -> Handle:
        # attended: [B, S, H/(PG), D] -> send: [S, B, H/(PG), D], rank j's tokens contiguous
        send = self.transport.send_buffer(shape, g)
        send.copy_(attended.transpose(0, 1))
        return self.transport.start(send, shape, g)

    def _place(self, out: torch.Tensor, received: torch.Tensor, g: int) -> None:
        # received: [P * L_r, B, H/(PG), D], source j's heads in block j -> out[:, :, group g's heads]
        p, length = self.transport.size, out.shape[1]
        blocks = received.view(p, length, *received.shape[1:]).permute(2, 1, 0, 3, 4)  # [B, L_r, P, H/(PG), D]
        self._group_heads(out, g).copy_(blocks)
