"""Which denoising steps run every block: one policy per ``cache.name``, in a registry.

A policy answers, per step and CFG branch, "compute the remaining blocks?" from the step index, the
relative L1 change of the first blocks' residual since the last computed step (reduced over the SP
group by the caller) and how many steps in a row were cached. Every rank of an SP group asks with the
same numbers, so every rank gets the same answer.
"""

from __future__ import annotations

import math
from typing import Optional

from ditrun.errors import UserError
from ditrun.registry import Registry


class NoCache:
    """Every step runs every block: the model is called whole."""

    splits = False
    needs_change = False

    def __init__(self, cache_cfg, steps: int):
        pass

    @staticmethod
    def check(cache_cfg, steps: int, num_blocks: int) -> None:
        pass

    def computes(self, step: int, change: Optional[float], cached_in_a_row: int) -> bool:
        return True


class FirstBlock:
    """The first ``cache.blocks`` blocks run every step; the rest run when their residual changed by at least
    ``cache.threshold`` (relative L1) since the last computed step, during warm-up, and after ``cache.max_cached``
    cached steps in a row."""

    splits = True
    needs_change = True

    def __init__(self, cache_cfg, steps: int):
        self.threshold, self.warmup, self.max_cached = cache_cfg.threshold, cache_cfg.warmup_steps, cache_cfg.max_cached

    @staticmethod
    def check(cache_cfg, steps: int, num_blocks: int) -> None:
        _check_blocks(cache_cfg, num_blocks, least=1)
        if not (0 <= cache_cfg.threshold < math.inf):
            raise UserError(f"cache.threshold={cache_cfg.threshold:g} must be 0 or more (0 computes every step).")
        if cache_cfg.warmup_steps < 1:
            raise UserError(
                f"cache.warmup_steps={cache_cfg.warmup_steps} must be at least 1 (the first step has nothing cached)."
            )
        if cache_cfg.max_cached is not None and cache_cfg.max_cached < 1:
            raise UserError(f"cache.max_cached={cache_cfg.max_cached} must be at least 1, or unset for no cap.")

    def computes(self, step: int, change: Optional[float], cached_in_a_row: int) -> bool:
        if step < self.warmup or change is None:
            return True
        if self.max_cached is not None and cached_in_a_row >= self.max_cached:
            return True
        return not change < self.threshold  # a NaN change computes


class StaticMask:
    """The steps given by config compute, whatever the weights: ``cache.compute_steps``, or the first
    ``compute_first`` and last ``compute_last`` steps and every ``compute_every``-th one from ``compute_first``."""

    splits = True
    needs_change = False

    def __init__(self, cache_cfg, steps: int):
        self.mask = static_mask(cache_cfg, steps)

    @staticmethod
    def check(cache_cfg, steps: int, num_blocks: int) -> None:
        _check_blocks(cache_cfg, num_blocks, least=0)
        for key in ("compute_first", "compute_last"):
            if getattr(cache_cfg, key) < 0:
                raise UserError(f"cache.{key}={getattr(cache_cfg, key)} must be 0 or more.")
        if cache_cfg.compute_every < 1:
            raise UserError(f"cache.compute_every={cache_cfg.compute_every} must be at least 1.")
        listed = cache_cfg.compute_steps
        if listed is not None and (0 not in listed or not all(0 <= int(s) < steps for s in listed)):
            raise UserError(
                f"cache.compute_steps={list(listed)} must hold step 0 (nothing is cached before it) and "
                f"only steps 0 to {steps - 1} (workload.steps={steps})."
            )

    def computes(self, step: int, change: Optional[float], cached_in_a_row: int) -> bool:
        return step in self.mask


def static_mask(cache_cfg, steps: int) -> frozenset[int]:
    """The steps a ``static`` cache computes."""
    if cache_cfg.compute_steps is not None:
        return frozenset(int(s) for s in cache_cfg.compute_steps)
    first, last, every = cache_cfg.compute_first, cache_cfg.compute_last, cache_cfg.compute_every
    return frozenset(i for i in range(steps) if i < max(first, 1) or i >= steps - last or (i - first) % every == 0)


def _check_blocks(cache_cfg, num_blocks: int, least: int) -> None:
    """``cache.blocks`` leaves at least one block to skip: with every block in the head a cached step computes all
    of them, and the run would record cached steps that saved nothing."""
    if num_blocks <= least:
        raise UserError(
            f"cache={cache_cfg.name} runs the first {least} block(s) every step, and the model has "
            f"{num_blocks}: no block is left for a cached step to skip."
        )
    if not least <= cache_cfg.blocks < num_blocks:
        raise UserError(
            f"cache.blocks={cache_cfg.blocks} must be {least} to {num_blocks - 1}, fewer than the "
            f"model's {num_blocks} blocks, so that a cached step skips some (cache={cache_cfg.name})."
        )


CACHE_POLICIES: Registry[type] = Registry("step cache")
for _name, _policy in (("none", NoCache), ("first_block", FirstBlock), ("static", StaticMask)):
    CACHE_POLICIES.register(_name, _policy)


def check_config(cache_cfg, steps: int, num_blocks: int) -> None:
    """Mistakes in ``cache.*``, one sentence each, before any model is built."""
    CACHE_POLICIES.get(cache_cfg.name, "cache").check(cache_cfg, steps, num_blocks)


def make_policy(cache_cfg, steps: int):
    return CACHE_POLICIES.get(cache_cfg.name, "cache")(cache_cfg, steps)
