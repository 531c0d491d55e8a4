"""The model's forward under a step cache: the first blocks every step, the rest when the policy says so.

A computed step runs ``head`` (the first ``cache.blocks`` blocks) then ``tail`` (the other blocks and
the output projection) and keeps the residual the tail added to the image tokens; a cached step runs
``head`` and ``finish``es ``head``'s output plus that residual (``cache.extrapolate``: extrapolated
linearly in the step index from the last two computed steps, TaylorSeer's first order). The parts are
the model's own methods, or their CUDA graphs (``BuiltModel.parts``), so compiled and graphed forwards
stay so.

State is kept per CFG branch (``cond``, ``uncond``, or ``both`` when a layout stacks them in one batch)
and per edit (a ``StepCache`` lives for one edit). A branch's rows decide together: a batch of two
computes when either row's change reaches the threshold. Each rank keeps the residuals of its own
tokens; only the two sums of the change statistic cross ranks, through the ``reduce`` it is given (the
layout's sum over its SP group), so every rank of a group decides alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ditrun.cache.policies import make_policy

# tensor -> the same tensor summed over the ranks that share this forward (identity on one rank)
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class BranchState:
    """One CFG branch's cache within one edit."""

    step: int = 0
    cached_in_a_row: int = 0
    head_residual: Optional[torch.Tensor] = None
    """The first blocks' residual at the last computed step (what the change is measured against)."""
    tail: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(step, residual of the remaining blocks) of the last computed steps, oldest first (two with extrapolation)."""
    computed: list[int] = field(default_factory=list)


def relative_l1(residual: torch.Tensor, previous: torch.Tensor, reduce: Reduce) -> float:
    """sum |residual - previous| / sum |previous| over every rank's tokens, per batch row; the largest row's.

    residual, previous: [B, S_r, C] -> a float, equal on every rank that ``reduce`` sums over."""
    diff = (residual.float() - previous.float()).abs().sum(dim=(1, 2), dtype=torch.float64)
    base = previous.float().abs().sum(dim=(1, 2), dtype=torch.float64)
    total = reduce(torch.stack([diff, base])).tolist()  # [2, B], one device sync per step
    return max(_ratio(d, b) for d, b in zip(*total))


def _ratio(diff: float, base: float) -> float:
    if base > 0:
        return diff / base
    return 0.0 if diff == 0 else math.inf


class StepCache:
    """The caching ``Forward`` (``model.sampler.Forward``) of one edit of ``steps`` steps: one state per branch."""

    def __init__(self, cache_cfg, steps: int, forward: Callable, parts, reduce: Reduce):
        self.name, self.steps, self.blocks = cache_cfg.name, steps, cache_cfg.blocks
        self.extrapolate = bool(cache_cfg.extrapolate)
        self.policy = make_policy(cache_cfg, steps)
        self.forward, self.parts, self.reduce = forward, parts, reduce
        self.states: dict[str, BranchState] = {}

    def __call__(self, branch: str, **inputs) -> torch.Tensor:
        state = self.states.setdefault(branch, BranchState())
        if not self.policy.splits:
            out = self.forward(**inputs)
            state.computed.append(state.step)
        else:
            out = self._split_call(state, inputs)
        state.step += 1
        return out

    def _split_call(self, state: BranchState, inputs: dict) -> torch.Tensor:
        stream, residual = self.parts.head(blocks=self.blocks, **inputs)
        change = None
        if self.policy.needs_change and state.head_residual is not None:
            change = relative_l1(residual, state.head_residual, self.reduce)
        if not state.tail or self.policy.computes(state.step, change, state.cached_in_a_row):
            attention = {key: inputs[key] for key in ("attention",) if key in inputs}
            out, tail_residual = self.parts.tail(stream=stream, blocks=self.blocks, **attention)
            state.head_residual = residual if self.policy.needs_change else None
            kept = state.tail[-1:] if self.extrapolate else []  # extrapolation needs the last two
            state.tail = [*kept, (state.step, tail_residual)]
            state.computed.append(state.step)
            state.cached_in_a_row = 0
            return out
        state.cached_in_a_row += 1
        return self.parts.finish(stream.img + self._reused(state), stream.temb)

    def _reused(self, state: BranchState) -> torch.Tensor:
        """The tail's residual for this step: the last computed one, or its linear extrapolation."""
        k, last = state.tail[-1]
        if len(state.tail) < 2:
            return last
        j, before = state.tail[0]
        slope = (state.step - k) / (k - j)
        return (last.float() + slope * (last.float() - before.float())).to(last.dtype)

    @property
    def forwards(self) -> int:
        """The forward calls this edit made so far, every branch, computed steps and cached ones."""
        return sum(state.step for state in self.states.values())

    def record_fields(self) -> dict:
        """An edit's record: the policy, steps computed and cached (of the conditional branch, which every
        layout's writing rank runs), and the computed steps of each branch this rank ran."""
        main = next((self.states[b] for b in ("cond", "both") if b in self.states), None)
        computed = len(main.computed) if main is not None else self.steps
        return {
            "cache": self.name,
            "steps_computed": computed,
            "steps_cached": self.steps - computed,
            "cache_computed": {branch: state.computed for branch, state in self.states.items()},
        }


def make_step_cache(cache_cfg, steps: int, built, reduce: Reduce) -> StepCache:
    """The step cache of one edit, over ``built``'s forward (``BuiltModel``) and its parts."""
    return StepCache(cache_cfg, steps, built.forward, built.parts, reduce)
