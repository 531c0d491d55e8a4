"""The step cache's arithmetic against closed forms computed here, and true CFG against its formula.

A toy model whose parts are known functions of the step stands in for the DiT: its head's residual and its
tail's residual are written down here, so what a cached step must return (the last computed step's tail
residual, or its linear extrapolation from the last two) and which steps ``first_block`` must compute (relative
L1 of the head's residual against the last computed step's, compared with the threshold) follow independently of
``ditrun.cache``."""

import math
import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from ditrun.cache import StepCache
from ditrun.config import CacheConfig
from ditrun.model.build import ModelParts
from ditrun.model.sampler import combine_cfg

STEPS = 10
X = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(1, 3, 4)
# The cache extrapolates in fp32 (then back to the residual's dtype): values of order 1 carry ~1e-7 of rounding.
# A wrong slope, step or residual is off by 1e-2 or more here.
TOL = {"rtol": 1e-6, "atol": 1e-6}


def head_residual(step: int) -> torch.Tensor:
    # changes a lot early, little late: the relative change falls as 1/(step+1)
    return X * (1.0 + sum(1.0 / (k + 1) for k in range(step + 1)))


def tail_residual(step: int) -> torch.Tensor:
    return torch.sin(X * (step + 1)) * 0.5 + step * 0.01


def image(step: int) -> torch.Tensor:
    return X * 2 + step


def finish(img: torch.Tensor, temb: float) -> torch.Tensor:
    assert img.dtype == torch.float64  # a reused residual comes back in its own dtype
    return img * 3 + temb


class ToyParts:
    """head/tail/finish with the signatures ``StepCache`` calls; they check that they get the configured number of
    blocks and, for the tail, the attention the step was given."""

    def __init__(self, blocks: int):
        self.blocks = blocks

    def head(self, *, blocks, step, attention):
        assert blocks == self.blocks
        return SimpleNamespace(img=image(step), temb=float(step), step=step), head_residual(step)

    def tail(self, *, stream, blocks, attention):
        assert blocks == self.blocks and attention == "the step's attention"
        return finish(stream.img + tail_residual(stream.step), stream.temb), tail_residual(stream.step)

    def parts(self) -> ModelParts:
        return ModelParts(self.head, self.tail, finish)


def uncached(*, step, attention):
    return finish(image(step) + tail_residual(step), float(step))


def run(cache: dict) -> tuple[list[torch.Tensor], list[int]]:
    cfg = OmegaConf.merge(OmegaConf.structured(CacheConfig), cache)
    parts = ToyParts(cfg.blocks).parts()
    step_cache = StepCache(cfg, STEPS, forward=uncached, parts=parts, reduce=lambda t: t)
    outs = [step_cache("cond", step=step, attention="the step's attention") for step in range(STEPS)]
    return outs, step_cache.states["cond"].computed


def expected_output(step: int, computed: list[int], extrapolate: bool) -> torch.Tensor:
    """The closed form: a computed step's own tail; a cached one's from the computed steps before it."""
    if step in computed:
        return finish(image(step) + tail_residual(step), float(step))
    before = [k for k in computed if k < step]
    k = before[-1]
    reused = tail_residual(k)
    if extrapolate and len(before) >= 2:
        j = before[-2]
        reused = tail_residual(k) + (step - k) / (k - j) * (tail_residual(k) - tail_residual(j))
    return finish(image(step) + reused, float(step))


def expected_first_block_steps(threshold: float, warmup: int, max_cached=None) -> list[int]:
    computed, in_a_row = [], 0
    for step in range(STEPS):
        if step < warmup or not computed:
            computed.append(step)
            continue
        last = head_residual(computed[-1])
        change = ((head_residual(step) - last).abs().sum() / last.abs().sum()).item()
        if change >= threshold or (max_cached is not None and in_a_row >= max_cached):
            computed.append(step)
            in_a_row = 0
        else:
            in_a_row += 1
    return computed


@pytest.mark.parametrize(
    "keys, mask",
    [
        ({"compute_steps": [0, 1, 4, 5, 9]}, [0, 1, 4, 5, 9]),
        ({"compute_first": 2, "compute_last": 2, "compute_every": 3}, [0, 1, 2, 5, 8, 9]),
        ({"compute_first": 0, "compute_last": 1, "compute_every": 4}, [0, 4, 8, 9]),
        ({"compute_first": 1, "compute_last": 0, "compute_every": 4}, [0, 1, 5, 9]),
    ],
)
@pytest.mark.parametrize("extrapolate", [False, True], ids=["reuse", "extrapolate"])
def test_static_mask_outputs_are_the_closed_form(keys, mask, extrapolate):
    """The mask from its definition: the first ``compute_first`` steps (step 0 at least), the last ``compute_last``,
    and every ``compute_every``-th from ``compute_first``; written out by hand for 10 steps."""
    outs, computed = run({"name": "static", "blocks": 2, **keys, "extrapolate": extrapolate})
    assert computed == mask
    for step, out in enumerate(outs):
        torch.testing.assert_close(out, expected_output(step, mask, extrapolate), **TOL)


@pytest.mark.parametrize(
    "threshold, warmup, max_cached",
    [(0.05, 1, None), (0.12, 2, None), (0.12, 1, 2), (0.0, 1, None), (math.inf, 1, 1), (math.inf, 3, 2)],
)
def test_first_block_decides_by_the_relative_l1_of_the_head_residual(threshold, warmup, max_cached):
    cache = {"name": "first_block", "blocks": 1, "threshold": threshold, "warmup_steps": warmup}
    cache["max_cached"] = max_cached
    cache["extrapolate"] = True
    outs, computed = run(cache)
    want = expected_first_block_steps(threshold, warmup, max_cached)
    assert computed == want
    assert 0 < len(want) < STEPS or threshold == 0.0  # the cases cache some steps (all compute at threshold 0)
    for step, out in enumerate(outs):
        torch.testing.assert_close(out, expected_output(step, want, True), **TOL)


@pytest.mark.parametrize("branches", [("cond", "uncond"), ("both",), ("uncond",)])
def test_the_record_counts_the_conditional_branchs_steps(branches):
    """Each branch decides on its own; the record's counts are the conditional branch's ("both" where a layout
    stacks the two), or every step where this rank ran only the unconditional one."""
    from ditrun.cache import make_step_cache

    cfg = OmegaConf.merge(OmegaConf.structured(CacheConfig), {"name": "static", "compute_steps": [0, 3, 6]})
    built = SimpleNamespace(forward=uncached, parts=ToyParts(cfg.blocks).parts())
    step_cache = make_step_cache(cfg, STEPS, built, lambda t: t)
    for step in range(STEPS):
        for branch in branches:
            step_cache(branch, step=step, attention="the step's attention")
    main = 3 if branches != ("uncond",) else STEPS
    assert step_cache.record_fields() == {
        "cache": "static",
        "steps_computed": main,
        "steps_cached": STEPS - main,
        "cache_computed": {branch: [0, 3, 6] for branch in branches},
    }
    assert step_cache.forwards == STEPS * len(branches)


def test_make_step_cache_runs_the_built_forward_and_reduces_over_the_group():
    from ditrun.cache import make_step_cache

    built = SimpleNamespace(forward=uncached, parts=ToyParts(1).parts())
    plain = make_step_cache(OmegaConf.structured(CacheConfig), STEPS, built, lambda t: t)
    torch.testing.assert_close(plain("cond", step=4, attention=None), uncached(step=4, attention=None))
    sums = []
    adaptive = OmegaConf.merge(OmegaConf.structured(CacheConfig), {"name": "first_block", "blocks": 1})
    step_cache = make_step_cache(adaptive, STEPS, built, lambda t: sums.append(t) or t)
    for step in range(3):
        step_cache("cond", step=step, attention="the step's attention")
    assert len(sums) == 2  # the change's two sums cross the group once per step after the first


def test_a_change_that_reaches_the_threshold_computes():
    """ "Changed by at least ``cache.threshold``": equality computes, just below caches (after warm-up)."""
    from ditrun.cache.policies import make_policy

    cfg = OmegaConf.merge(OmegaConf.structured(CacheConfig), {"name": "first_block", "threshold": 0.08})
    policy = make_policy(cfg, STEPS)
    assert policy.computes(5, 0.08, 0) and not policy.computes(5, 0.0799, 0) and policy.computes(5, math.nan, 0)


def test_an_extrapolated_residual_keeps_its_dtype():
    from ditrun.cache.forward import BranchState

    cfg = OmegaConf.merge(OmegaConf.structured(CacheConfig), {"name": "static", "extrapolate": True})
    step_cache = StepCache(cfg, STEPS, forward=None, parts=None, reduce=lambda t: t)
    r0, r2 = torch.full((1, 2, 2), 1.0, dtype=torch.bfloat16), torch.full((1, 2, 2), 2.0, dtype=torch.bfloat16)
    reused = step_cache._reused(BranchState(step=3, tail=[(0, r0), (2, r2)]))
    assert reused.dtype == torch.bfloat16 and torch.equal(reused, torch.full_like(r2, 2.5))  # 2 + (3-2)/(2-0) * 1


def test_no_cache_runs_the_whole_forward_every_step():
    outs, computed = run({"name": "none"})
    assert computed == list(range(STEPS))
    for step, out in enumerate(outs):
        torch.testing.assert_close(out, uncached(step=step, attention=None))


@pytest.mark.parametrize(
    "previous, residual, want",
    [
        ([[1.0, -2.0], [3.0, 0.0]], [[1.5, -2.0], [3.0, 1.0]], 1.5 / 6.0),
        ([[0.25, 0.25]], [[0.5, 0.25]], 0.5),  # a base below 1 is a base
        ([[0.0, 0.0]], [[0.0, 0.0]], 0.0),  # nothing changed, from nothing: cache
        ([[0.0, 0.0]], [[0.0, 1e-30]], math.inf),  # anything from nothing: compute
    ],
)
def test_the_change_is_the_relative_l1_of_the_largest_row(previous, residual, want):
    from ditrun.cache.forward import relative_l1

    prev, res = torch.tensor([previous]), torch.tensor([residual])
    assert relative_l1(res, prev, lambda t: t) == pytest.approx(want)
    # two rows: the larger change decides; the reduce (an SP group's sum) is applied to both sums
    rows = relative_l1(torch.cat([prev, res]), torch.cat([prev, prev]), lambda t: t * 2)
    assert rows == pytest.approx(want)


@pytest.mark.parametrize(
    "cache, error",
    [
        ({"name": "first_block", "threshold": -0.01}, "cache.threshold=-0.01 must be 0 or more"),
        ({"name": "first_block", "threshold": math.inf}, "cache.threshold=inf must be 0 or more"),
        ({"name": "first_block", "warmup_steps": 0}, "cache.warmup_steps=0 must be at least 1"),
        ({"name": "first_block", "max_cached": 0}, "cache.max_cached=0 must be at least 1"),
        ({"name": "static", "compute_first": -1}, "cache.compute_first=-1 must be 0 or more"),
        ({"name": "static", "compute_last": -1}, "cache.compute_last=-1 must be 0 or more"),
        ({"name": "static", "compute_every": 0}, "cache.compute_every=0 must be at least 1"),
        ({"name": "static", "compute_steps": [1, 2]}, "must hold step 0"),
        ({"name": "static", "compute_steps": [0, 10]}, "only steps 0 to 9"),
        ({"name": "first_block", "blocks": 4}, "cache.blocks=4 must be 1 to 3"),
        ({"name": "static", "blocks": 4}, "cache.blocks=4 must be 0 to 3"),
    ],
)
def test_cache_settings_at_and_past_their_bounds(cache, error):
    """Each key's first refused value is refused, and the value at its bound is accepted."""
    from ditrun.cache.policies import check_config
    from ditrun.errors import UserError

    cfg = OmegaConf.merge(OmegaConf.structured(CacheConfig), cache)
    with pytest.raises(UserError, match=re.escape(error)):
        check_config(cfg, STEPS, num_blocks=4)


@pytest.mark.parametrize(
    "cache",
    [
        {"name": "first_block", "threshold": 0.0, "warmup_steps": 1, "max_cached": 1, "blocks": 3},
        {"name": "static", "compute_first": 0, "compute_last": 0, "compute_every": 1, "blocks": 0},
        {"name": "static", "compute_steps": [0, 9], "blocks": 3},
    ],
)
def test_cache_settings_at_their_bounds_are_accepted(cache):
    from ditrun.cache.policies import check_config

    check_config(OmegaConf.merge(OmegaConf.structured(CacheConfig), cache), STEPS, num_blocks=4)


def test_a_model_with_no_block_to_skip_is_refused():
    from ditrun.cache.policies import check_config
    from ditrun.errors import UserError

    first_block = OmegaConf.merge(OmegaConf.structured(CacheConfig), {"name": "first_block"})
    with pytest.raises(UserError, match="the model has 1: no block is left"):
        check_config(first_block, STEPS, num_blocks=1)
    static = OmegaConf.merge(OmegaConf.structured(CacheConfig), {"name": "static", "blocks": 0})
    check_config(static, STEPS, num_blocks=1)  # a static cache may skip the only block


@pytest.mark.parametrize("scale", [1.0, 2.5, 7.0])
def test_true_cfg_is_the_guided_formula(scale):
    """uncond + scale * (cond - uncond): a swapped pair or a scale applied to the wrong term fails at these values."""
    cond, uncond = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 4.0, -1.0])
    want = torch.tensor([0.5 + scale * 0.5, 4.0 + scale * -6.0, -1.0 + scale * 4.0])
    torch.testing.assert_close(combine_cfg(cond, uncond, scale), want)
    if scale != 1.0:
        assert not torch.allclose(combine_cfg(uncond, cond, scale), want)
