"""The velocity function of each layout: where the two branches of true CFG run.

* ``single``: one process, conditional then unconditional branch (the sampler's own function);
* ``ulysses``: the same two passes, each sequence-parallel over the whole SP group;
* ``cfg_batch``: both branches stacked in the batch, one sequence-parallel pass;
* ``cfg_split``: the cfg axis splits the replica in two SP groups that run one branch each at
  the same time; paired ranks (same SP index) swap their predictions to combine guidance.

With true CFG off (``true_cfg_scale`` <= 1, diffusers' rule) only the conditional branch runs:
``ulysses`` and ``cfg_batch`` then make one batch-1 pass per step, and ``cfg_split`` is refused
(half its ranks would have nothing to do).

Guidance is combined on each rank's own output tokens (it is elementwise), then the guided
velocity is gathered over the SP group, so every rank steps the full latent identically.
"""

from __future__ import annotations

from typing import Optional

import torch

from ditrun.errors import UserError
from ditrun.kernels.attention_payload import Payload
from ditrun.model.sampler import EditInputs, Forward, VelocityFn, branch_inputs, combine_cfg, sequential_branches
from ditrun.parallel.layout import layout_kind
from ditrun.parallel.placement import Layout
from ditrun.parallel.ulysses import STATISTICS, SequenceShards, UlyssesAttention, attention_shapes
from ditrun.transport.base import ExchangeShape, Transport, all_gather_rows, gather_shape

# FluxDiT.forward inputs that have no batch dim: both branches share them.
_SHARED_INPUTS = ("img_ids", "txt_ids")


def check_true_cfg(layout_name: str, true_cfg_scale: float) -> None:
    """A layout that splits the CFG branches (``cfg_split``) needs both: refuse it, before any work, when
    true CFG is off."""
    if layout_kind(layout_name).needs_true_cfg and true_cfg_scale <= 1:
        raise UserError(
            f"layout={layout_name} runs the unconditional branch on half the ranks, but "
            f"workload.true_cfg_scale={true_cfg_scale} turns true CFG off (it needs > 1); use "
            "layout=ulysses or cfg_batch, or raise workload.true_cfg_scale."
        )


class LocalBranches:
    """The DiT on this rank's share of the joint sequence; returns its output tokens' velocity."""

    def __init__(
        self,
        forward: Forward,
        inputs: EditInputs,
        shards: SequenceShards,
        attention,
        dtype: torch.dtype,
        guidance: Optional[float],
    ):
        self.forward, self.shards, self.attention = forward, shards, attention
        self.local, self.dtype, self.guidance = shards.local_inputs(inputs), dtype, guidance
        self.n_out = shards.output[shards.rank]

    def _inputs(self, x: torch.Tensor, sigma: float, conditional: bool) -> dict:
        return branch_inputs(
            self.local, x[:, self.shards.output_slice()], sigma, conditional, self.dtype, self.guidance
        )

    def one(self, x: torch.Tensor, sigma: float, conditional: bool) -> torch.Tensor:
        # x: [1, O, C] full latent -> [1, O_r, C] fp32
        branch = "cond" if conditional else "uncond"
        out = self.forward(branch, **self._inputs(x, sigma, conditional), attention=self.attention)
        return out[:, : self.n_out].float()

    def both_batched(self, x: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [1, O, C] -> (cond, uncond), each [1, O_r, C] fp32, from one pass with batch 2
        cond, uncond = self._inputs(x, sigma, True), self._inputs(x, sigma, False)
        stacked = {k: v if k in _SHARED_INPUTS or v is None else torch.cat([v, uncond[k]]) for k, v in cond.items()}
        out = self.forward("both", **stacked, attention=self.attention)[:, : self.n_out].float()
        return out[:1], out[1:]


def _shards(transports: dict[str, Transport], inputs: EditInputs) -> SequenceShards:
    sp = transports["sp"]
    return SequenceShards.split(
        inputs.prompt.shape[1], inputs.noise.shape[1], inputs.ref_latents.shape[1], sp.size, sp.rank
    )


def exchange_shapes(
    layout: Layout,
    transports: dict[str, Transport],
    inputs: EditInputs,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    payload: Optional[Payload] = None,
) -> dict[str, list[ExchangeShape]]:
    """Every exchange one edit's velocity makes, per axis: what ``prepare`` sizes buffers for.

    They are the shapes the exchange sites build themselves (``attention_shapes``, ``all_gather_rows``):
    Q/K/V (the ``payload``'s codes, and its statistics, when there is one) and attention outputs in the model
    dtype, the guided velocity (fp32) over ``sp``, and under ``cfg_split`` the prediction swap (fp32) over ``cfg``.
    """
    kind = layout.plan.kind
    if kind.one_worker:
        return {}
    shards, channels = _shards(transports, inputs), inputs.noise.shape[-1]
    batch = 2 if kind.batched_cfg and inputs.true_cfg else 1
    sp = [
        *attention_shapes(shards.joint, batch, num_heads, head_dim, layout.plan.head_groups, dtype, payload),
        gather_shape("velocity_gather", shards.output, (1, channels), torch.float32),
    ]
    if kind.cfg_degree == 1:
        return {"sp": sp}
    mine = shards.output[shards.rank]
    return {"sp": sp, "cfg": [gather_shape("cfg_pair", [mine, mine], (channels,), torch.float32)]}


def prepare_transports(
    layout: Layout,
    transports: dict[str, Transport],
    inputs: EditInputs,
    geometry,
    dtype: torch.dtype,
    payload: Optional[Payload] = None,
) -> None:
    """Size and map every transport's buffers for one edit (collective over each axis; untimed)."""
    heads, head_dim = geometry.num_attention_heads, geometry.attention_head_dim
    shapes = exchange_shapes(layout, transports, inputs, heads, head_dim, dtype, payload)
    for axis, axis_shapes in shapes.items():
        transports[axis].prepare(axis_shapes)


def layout_velocity(
    layout: Layout,
    transports: dict[str, Transport],
    forward: Forward,
    inputs: EditInputs,
    guidance_scale: float,
    guidance: Optional[float],
    dtype: torch.dtype,
    inner_attention=None,
    payload: Optional[Payload] = None,
) -> VelocityFn:
    """The guided velocity of one edit under ``layout``; ``transports`` has one per axis (``sp``, ``cfg``).
    ``payload``: Q, K and V cross the SP exchange as its codes (``BuiltModel.payload``)."""
    kind = layout.plan.kind
    if kind.one_worker:
        return sequential_branches(forward, inputs, guidance_scale, guidance, dtype, attention=inner_attention)
    sp = transports["sp"]
    shards = _shards(transports, inputs)
    if sp.size == 1 and layout.plan.head_groups == 1 and inner_attention is not None:
        attention = inner_attention  # nothing to exchange: the run's own kernel, as in ``single`` (compiled into
        # the whole block, and the forward graphable: ``model/graphs.py``)
    else:
        extra = {} if inner_attention is None else {"inner": inner_attention}
        attention = UlyssesAttention(sp, shards.joint, layout.plan.head_groups, payload=payload, **extra)
    branches = LocalBranches(forward, inputs, shards, attention, dtype, guidance)
    if kind.cfg_degree == 2:
        return _split(branches, sp, transports["cfg"], guidance_scale)
    if kind.batched_cfg:
        return _batched(branches, sp, guidance_scale)
    return _sequential(branches, sp, guidance_scale)


def _sequential(branches: LocalBranches, sp: Transport, scale: float) -> VelocityFn:
    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        guided = branches.one(x, sigma, True)
        if branches.local.true_cfg:
            guided = combine_cfg(guided, branches.one(x, sigma, False), scale)
        return branches.shards.gather_output(sp, guided)

    return velocity


def _batched(branches: LocalBranches, sp: Transport, scale: float) -> VelocityFn:
    if not branches.local.true_cfg:  # one branch: nothing to stack
        return _sequential(branches, sp, scale)

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        guided = combine_cfg(*branches.both_batched(x, sigma), scale)
        return branches.shards.gather_output(sp, guided)

    return velocity


def _split(branches: LocalBranches, sp: Transport, cfg: Transport, scale: float) -> VelocityFn:
    # Index 0 on the cfg axis runs the conditional branch, index 1 the unconditional one.
    conditional = cfg.rank == 0

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        mine = branches.one(x, sigma, conditional)[0]  # [O_r, C]
        pair = all_gather_rows(cfg, mine, [mine.shape[0]] * 2, "cfg_pair")  # [2 O_r, C]: cond, uncond
        cond, uncond = pair.chunk(2)
        return branches.shards.gather_output(sp, combine_cfg(cond, uncond, scale)[None])

    return velocity


ATTENTION_EXCHANGES = ("qkv", "attention_out", STATISTICS)
"""The exchange kinds of sequence-parallel attention (what ``exchange_bytes_per_forward`` sums)."""


def exchange_fields(transports: dict[str, Transport], forwards: int, payload: Optional[Payload]) -> dict:
    """An edit's record of what its exchanges moved, as this rank's transports counted it (``SentBytes``): bytes
    sent to peers per exchange kind over the edit, and attention's per DiT forward (``forwards``: the forward
    calls of the edit, cached steps' included), and whether Q, K and V crossed as codes."""
    sent: dict[str, int] = {}
    for transport in transports.values():
        for kind, count in transport.sent.take().items():
            sent[kind] = sent.get(kind, 0) + count
    attention = sum(sent.get(kind, 0) for kind in ATTENTION_EXCHANGES)
    return {
        "quantized_exchange": payload is not None and transports["sp"].size > 1,
        "exchange_bytes": sent,
        "exchange_bytes_per_forward": attention / forwards if forwards else 0.0,
    }
