"""Flow-matching Euler with the Flux shift, true CFG and Kontext-style reference tokens."""

import math

import numpy as np
import pytest
import torch

from ditrun.errors import UserError
from ditrun.kernels.attention_payload import PAYLOADS
from ditrun.model import random_model
from ditrun.model.dit import sdpa_attention
from ditrun.model.latents import LinearLatentMap, pack, token_ids, unpack
from ditrun.model.presets import PRESETS
from ditrun.model.sampler import (
    EditInputs,
    branch_inputs,
    combine_cfg,
    denoise,
    flux_sigmas,
    sequential_cfg_velocity,
)
from ditrun.parallel.cfg import check_true_cfg, exchange_shapes, layout_velocity
from ditrun.parallel.layout import LayoutPlan
from ditrun.parallel.placement import Layout, Placement, build_layout
from ditrun.transport.base import LocalTransport


def test_sigmas_match_diffusers_flux_scheduler():
    diffusers = pytest.importorskip("diffusers")

    for steps, seq_len in [(4, 256), (28, 4096), (8, 1024)]:
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
            shift=3.0,
        )
        mu = 0.5 + (1.15 - 0.5) * (seq_len - 256) / (4096 - 256)  # FLUX.1: shift 0.5 at 256 tokens, 1.15 at 4096
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        np.testing.assert_allclose(flux_sigmas(steps, seq_len), scheduler.sigmas.numpy(), rtol=1e-6, atol=1e-7)


def _edit_inputs(seed=0, h=4, w=6):
    geo = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(seed)
    n = (h // 2) * (w // 2)
    return geo, EditInputs(
        noise=torch.randn(1, n, 64, generator=gen),
        ref_latents=torch.randn(1, n, 64, generator=gen),
        img_ids=token_ids(h, w, 0),
        ref_ids=token_ids(h, w, 1),
        prompt=torch.randn(1, 5, geo.joint_attention_dim, generator=gen),
        pooled=torch.randn(1, geo.pooled_projection_dim, generator=gen),
        neg_prompt=torch.randn(1, 5, geo.joint_attention_dim, generator=gen),
        neg_pooled=torch.randn(1, geo.pooled_projection_dim, generator=gen),
        txt_ids=torch.zeros(5, 3),
    )


def _sample(seed, scale=2.5, steps=3):
    geo, inputs = _edit_inputs(seed)
    model = random_model(geo, seed=0)
    velocity = sequential_cfg_velocity(model, inputs, scale, 3.5, torch.float32)
    with torch.no_grad():
        return denoise(velocity, inputs.noise, steps)


@pytest.mark.slow
def test_same_seed_same_output_and_seed_matters():
    a, b, c = _sample(0), _sample(0), _sample(1)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


@pytest.mark.slow
def test_guidance_scale_one_is_the_conditional_branch():
    """With scale 1, true CFG reduces to the conditional prediction: check against a direct loop."""
    geo, inputs = _edit_inputs(2)
    model = random_model(geo, seed=0)
    with torch.no_grad():
        got = denoise(sequential_cfg_velocity(model, inputs, 1.0, 3.5, torch.float32), inputs.noise, 2)
        sigmas = flux_sigmas(2, inputs.noise.shape[1])
        x = inputs.noise.clone()
        for i in range(2):
            v = model(**branch_inputs(inputs, x, sigmas[i], True, torch.float32, 3.5))[:, : x.shape[1]]
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    torch.testing.assert_close(got, x, rtol=1e-6, atol=1e-6)


def test_reference_tokens_follow_the_kontext_convention():
    _, inputs = _edit_inputs(3)
    ids = inputs.model_ids
    n = inputs.noise.shape[1]
    assert (ids[:n, 0] == 0).all() and (ids[n:, 0] == 1).all()
    assert torch.equal(ids[:n, 1:], ids[n:, 1:])
    kw = branch_inputs(inputs, inputs.noise, 0.5, True, torch.float32, None)
    assert kw["hidden_states"].shape[1] == 2 * n and kw["guidance"] is None


@pytest.mark.slow
def test_reference_image_changes_the_edit():
    geo, inputs = _edit_inputs(4)
    model = random_model(geo, seed=0)
    with torch.no_grad():
        a = denoise(sequential_cfg_velocity(model, inputs, 2.5, 3.5, torch.float32), inputs.noise, 2)
        inputs.ref_latents = inputs.ref_latents * -1
        b = denoise(sequential_cfg_velocity(model, inputs, 2.5, 3.5, torch.float32), inputs.noise, 2)
    assert not torch.allclose(a, b)


def test_pack_unpack_and_linear_latent_map_roundtrip():
    latent = torch.randn(1, 16, 6, 8)
    assert torch.equal(unpack(pack(latent), 6, 8), latent)
    codec = LinearLatentMap()
    flat = torch.rand(1, 3, 1, 1).expand(1, 3, 48, 64).contiguous()  # constant colour: exact through the map
    torch.testing.assert_close(codec.decode(codec.encode(flat)), flat, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_true_cfg_off_runs_one_branch_per_step():
    """Without negative embeddings (true_cfg_scale <= 1) each step is one conditional forward."""
    geo, inputs = _edit_inputs(5)
    inputs.neg_prompt = inputs.neg_pooled = None
    model, calls = random_model(geo, seed=0), []
    model.register_forward_hook(lambda module, args, output: calls.append(1))
    with torch.no_grad():
        got = denoise(sequential_cfg_velocity(model, inputs, 1.0, 3.5, torch.float32), inputs.noise, 2)
        calls_off = len(calls)
        _, with_neg = _edit_inputs(5)
        expected = denoise(sequential_cfg_velocity(model, with_neg, 1.0, 3.5, torch.float32), with_neg.noise, 2)
    assert calls_off == 2 and len(calls) == 2 + 4
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # scale 1 with both branches is the same


def test_true_cfg_is_the_unconditional_branch_plus_the_scaled_difference():
    cond, uncond = torch.tensor([1.0, 2.0, -0.5]), torch.tensor([5.0, -3.0, -0.5])
    assert combine_cfg(cond, uncond, 4.0).tolist() == [5 + 4 * (1 - 5), -3 + 4 * (2 + 3), -0.5]
    assert torch.equal(combine_cfg(cond, uncond, 1.0), cond)


class _RecordedForward:
    """The model's forward (in fp32), with each call's branch, input dtypes and attention written to a log."""

    def __init__(self, model):
        self.model, self.log = model, []

    def __call__(self, branch: str, **inputs):
        floats = {k: v.dtype for k, v in inputs.items() if torch.is_tensor(v) and v.is_floating_point()}
        self.log.append((branch, floats, inputs.get("attention")))
        inputs = {k: v.float() if k in floats and k not in ("img_ids", "txt_ids") else v for k, v in inputs.items()}
        return self.model(**inputs)


def _inner_attention(q, k, v):
    """A run's own attention kernel, as a function of its own (the layouts must hand on this one, not the default)."""
    return sdpa_attention(q, k, v)


def test_each_branch_gets_its_own_prompt_in_the_compute_dtype():
    _, inputs = _edit_inputs(6)
    x = inputs.noise
    for conditional, prompt, pooled in [
        (True, inputs.prompt, inputs.pooled),
        (False, inputs.neg_prompt, inputs.neg_pooled),
    ]:
        kw = branch_inputs(inputs, x, 0.3, conditional, torch.bfloat16, 3.5)
        assert torch.equal(kw["encoder_hidden_states"], prompt.bfloat16())
        assert torch.equal(kw["pooled_projections"], pooled.bfloat16())
        assert torch.equal(kw["hidden_states"], torch.cat([x, inputs.ref_latents], dim=1).bfloat16())
        assert kw["timestep"].tolist() == [0.30000001192092896] and kw["timestep"].dtype == torch.float32


@pytest.mark.parametrize(
    "layout, head_groups, inner, branches",
    [
        ("single", 1, _inner_attention, ["cond", "uncond"]),
        ("ulysses", 1, _inner_attention, ["cond", "uncond"]),
        ("ulysses", 2, _inner_attention, ["cond", "uncond"]),
        ("cfg_batch", 1, None, ["both"]),
    ],
)
def test_each_one_process_layout_guides_by_the_formula(layout, head_groups, inner, branches):
    """The layouts' branch pairing on one process (an SP group of one): velocity = uncond + s (cond - uncond), with
    each branch computed here by the model itself, at a scale for which swapped or unscaled branches are far off."""
    geo, inputs = _edit_inputs(6)
    model, n, scale = random_model(geo, seed=0), inputs.noise.shape[1], 4.0
    x = torch.randn(inputs.noise.shape, generator=torch.Generator().manual_seed(7))
    payload = PAYLOADS.get("int8qk")("emulation")
    with torch.no_grad():
        cond, uncond = (
            model(
                **{
                    k: v.float() if k not in ("img_ids", "txt_ids") and torch.is_tensor(v) else v
                    for k, v in branch_inputs(inputs, x, 0.7, branch, torch.bfloat16, 3.5).items()
                }
            )[:, :n].double()
            for branch in (True, False)
        )
        plan = LayoutPlan(layout, replicas=1, cfg_degree=1, sp_degree=1, head_groups=head_groups)
        forward = _RecordedForward(model)
        velocity = layout_velocity(
            build_layout(Placement.on_one_node(plan)),
            {"sp": LocalTransport()},
            forward,
            inputs,
            scale,
            3.5,
            torch.bfloat16,
            inner_attention=inner,
            payload=payload,
        )
        got = velocity(x, 0.7).double()
    want = uncond + scale * (cond - uncond)
    tolerance = 1e-5 * want.abs().max()  # fp32 forwards; cfg_batch's batch of two sums in another order
    assert (got - want).abs().max() <= tolerance
    for wrong in (cond + scale * (uncond - cond), cond, uncond + (scale - 1) * (cond - uncond)):
        assert (wrong - want).abs().max() > 100 * tolerance
    assert [branch for branch, _, _ in forward.log] == branches
    for _, dtypes, attention in forward.log:
        assert {k: v for k, v in dtypes.items() if k not in ("img_ids", "txt_ids")} == dict.fromkeys(
            ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"], torch.bfloat16
        ) | {"timestep": torch.float32, "guidance": torch.float32}
        if layout == "single" or head_groups == 1 and inner is not None:
            assert attention is inner  # nothing to exchange: the run's own kernel
        else:  # Ulysses attention over the SP group of one, with the layout's head groups and payload
            assert attention.splits == [5 + 2 * n] and attention.head_groups == head_groups
            assert attention.payload is payload and attention.inner is (inner or sdpa_attention)
    plans = exchange_shapes(
        build_layout(Placement.on_one_node(plan)), {"sp": LocalTransport()}, inputs, 4, 16, torch.bfloat16
    )
    if layout == "single":
        assert plans == {}
    else:  # an SP group of one: its own rows, the guided velocity in fp32; cfg_batch stacks both branches
        qkv, out, velocity_gather = plans["sp"]
        batch = 2 if layout == "cfg_batch" else 1
        joint = 5 + 2 * n
        assert (
            qkv.counts == ((joint,),)
            and qkv.row_shape == (3, batch, 4 // head_groups, 16)
            and qkv.dtype == torch.bfloat16
        )
        assert out.counts == ((joint,),) and out.row_shape == (batch, 4 // head_groups, 16)
        assert velocity_gather.counts == ((n,),) and velocity_gather.row_shape == (1, 64)
        assert velocity_gather.dtype == torch.float32 and list(plans) == ["sp"]
        coded = exchange_shapes(
            build_layout(Placement.on_one_node(plan)), {"sp": LocalTransport()}, inputs, 4, 16, torch.bfloat16, payload
        )
        assert coded["sp"][0].dtype == torch.uint8 and coded["sp"][2].kind == "attention_statistics"


def test_cfg_split_swaps_one_prediction_per_rank_over_the_cfg_axis():
    _, inputs = _edit_inputs(6)
    plan = LayoutPlan("cfg_split", replicas=1, cfg_degree=2, sp_degree=1, head_groups=1)
    transports = {"sp": LocalTransport(), "cfg": LocalTransport()}
    plans = exchange_shapes(Layout(Placement.on_one_node(plan), rank=0), transports, inputs, 4, 16, torch.bfloat16)
    n = inputs.noise.shape[1]
    assert [p.kind for p in plans["sp"]] == ["qkv", "attention_out", "velocity_gather"]
    (pair,) = plans["cfg"]
    assert pair.kind == "cfg_pair" and pair.counts == ((n, n), (n, n)) and pair.row_shape == (64,)
    assert pair.dtype == torch.float32
    with pytest.raises(UserError, match="layout=cfg_split runs the unconditional branch on half the ranks"):
        check_true_cfg("cfg_split", 1.0)
    check_true_cfg("cfg_split", 1.5)
    check_true_cfg("cfg_batch", 1.0)


def test_sigmas_are_the_shifted_schedule_in_fp64_then_zero():
    mu = 0.5  # 256 tokens
    t = [1.0, 2 / 3, 1 / 3]
    want = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in t] + [0.0]
    assert flux_sigmas(3, 256) == pytest.approx(want, rel=1e-15, abs=0)
    assert flux_sigmas(1, 256) == [1.0, 0.0]
    with pytest.raises(UserError, match=r"^workload.steps=0 must be at least 1.$"):
        flux_sigmas(0, 256)
