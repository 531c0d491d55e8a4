"""Step caching (``cache=``, ``ditrun/cache``): through the real worker, on one process and on 2 and 4 gloo ranks.

The workload is the layout tests' tiny one (32x48 pixels, 7 text tokens, 8 heads) with 5 steps. With its
seeded random weights the first block's residual changes by 0.45 to 0.70 (relative L1) from step to step,
so ``cache.threshold=0.6`` with at most 2 cached steps in a row caches some steps of each branch and
computes others, and no change lies within 0.01 of it: layouts, which round differently by about 1e-6,
take the same decisions.
"""

import inspect
import json
from pathlib import Path

import pytest
import torch
from launching import MAX_RELATIVE_ERROR, ditrun_command, latents, records, relative_error, run, tiny_config
from ranks import run_ranks

from ditrun import config
from ditrun.cache.forward import relative_l1
from ditrun.cache.policies import CACHE_POLICIES, FirstBlock, static_mask
from ditrun.config import CacheConfig
from ditrun.metrics.quality import QUALITY_MEASURES
from ditrun.parallel.layout import plan_layout
from ditrun.parallel.placement import Placement, build_layout
from ditrun.run import checks, worker

STEPS = 5
BASE = [f"workload.steps={STEPS}", "metrics.ssim=false", "metrics.report=false"]
ADAPTIVE = ["cache=first_block", "cache.threshold=0.6", "cache.max_cached=2"]
DEBUG_COMPILE = ["model.compile=on", "model.compile_backend=aot_eager"]


def run_single(out, *overrides: str) -> dict:
    worker.run(tiny_config(*BASE, *overrides), out)
    return records(out)[0]


def _run_worker(rank, world, cfg, out_dir):
    return worker.run(cfg, out_dir)


def run_layout(out, world: int, *overrides: str) -> dict:
    cfg = tiny_config(*BASE, *overrides, f"launcher.world={world}")
    run_ranks(_run_worker, world, (cfg, out), timeout=150)
    return records(out)[0]


@pytest.fixture(scope="module")
def single_adaptive(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_adaptive")
    record = run_single(out, *ADAPTIVE)
    computed = record["cache_computed"]
    # The test means something only if both decisions happen, in both branches.
    assert set(computed) == {"cond", "uncond"}
    assert all(0 < len(steps) < STEPS for steps in computed.values()), computed
    return out, record


# ---------------------------------------------------------------------------------------------
# One process


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_threshold_zero_equals_no_cache_bitwise(tmp_path, compiled):
    """Threshold 0 computes every step, through the split forward (head, then tail): bitwise the whole one."""
    extra = DEBUG_COMPILE if compiled else []
    plain = run_single(tmp_path / "none", *extra)
    cached = run_single(tmp_path / "zero", *extra, "cache=first_block", "cache.threshold=0", "cache.extrapolate=true")
    assert torch.equal(latents(tmp_path / "zero", "astronaut"), latents(tmp_path / "none", "astronaut"))
    assert (plain["cache"], plain["steps_computed"], plain["steps_cached"]) == ("none", STEPS, 0)
    assert (cached["cache"], cached["steps_computed"], cached["steps_cached"]) == ("first_block", STEPS, 0)
    assert cached["cache_computed"] == {"cond": list(range(STEPS)), "uncond": list(range(STEPS))}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_caching_changes_the_result_and_the_summary_counts_it(single_adaptive, tmp_path):
    out, record = single_adaptive
    run_single(tmp_path / "none")
    assert not torch.equal(latents(out, "astronaut"), latents(tmp_path / "none", "astronaut"))
    assert record["steps_computed"] == len(record["cache_computed"]["cond"])
    assert record["steps_cached"] == STEPS - record["steps_computed"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_computed_median"] == record["steps_computed"]
    assert summary["steps_cached_median"] == record["steps_cached"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_cached_run_equals_eager_with_the_same_decisions(single_adaptive, tmp_path):
    """The cached steps run the compiled first block only; decisions and latents are the eager run's."""
    out, eager = single_adaptive
    compiled = run_single(tmp_path, *ADAPTIVE, *DEBUG_COMPILE)
    assert compiled["cache_computed"] == eager["cache_computed"]
    assert relative_error(latents(tmp_path, "astronaut"), latents(out, "astronaut")) <= MAX_RELATIVE_ERROR


# ---------------------------------------------------------------------------------------------
# Static masks


@pytest.mark.parametrize(
    "keys, steps, expected",
    [
        (dict(compute_first=0, compute_last=0, compute_every=2), 28, set(range(0, 28, 2))),  # 14 of 28
        (dict(compute_first=0, compute_last=0, compute_every=3), 28, set(range(0, 28, 3))),  # 10 of 28
        (dict(compute_first=2, compute_last=2, compute_every=4), 12, {0, 1, 2, 6, 10, 11}),
        (dict(compute_first=1, compute_last=1, compute_every=2), 6, {0, 1, 3, 5}),
        (dict(compute_steps=[0, 4, 2]), 6, {0, 2, 4}),
    ],
)
def test_static_mask_is_the_configured_steps(keys, steps, expected):
    assert static_mask(CacheConfig(name="static", **keys), steps) == expected


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_static_run_computes_exactly_the_listed_steps(tmp_path):
    record = run_single(tmp_path, "cache=static", "cache.compute_steps=[0,2,3]")
    assert record["cache_computed"] == {"cond": [0, 2, 3], "uncond": [0, 2, 3]}
    assert (record["steps_computed"], record["steps_cached"]) == (3, 2)


def test_config_names_every_registered_policy_and_measure():
    source = inspect.getsource(config.CacheConfig)
    assert all(f"``{name}``" in source for name in CACHE_POLICIES)
    presets = Path(config.__file__).parent / "conf" / "cache"
    assert sorted(p.stem for p in presets.glob("*.yaml")) == sorted(CACHE_POLICIES)
    assert all(f"``{name}``" in inspect.getsource(config.MetricsConfig) for name in QUALITY_MEASURES)


MASK_RULE = f"must hold step 0 (nothing is cached before it) and only steps 0 to {STEPS - 1} (workload.steps={STEPS})."


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cache=static", "cache.compute_steps=[1,2]"], f"cache.compute_steps=[1, 2] {MASK_RULE}"),
        (["cache=static", "cache.compute_steps=[0,5]"], f"cache.compute_steps=[0, 5] {MASK_RULE}"),
        (
            ["cache=first_block", "cache.blocks=99"],
            "cache.blocks=99 must be 1 to 3, fewer than the model's 4 blocks, so that a cached step skips some "
            "(cache=first_block).",
        ),
        (
            ["cache=static", "cache.blocks=4"],
            "cache.blocks=4 must be 0 to 3, fewer than the model's 4 blocks, so that a cached step skips some "
            "(cache=static).",
        ),
        (["cache=first_block", "cache.threshold=-1"], "cache.threshold=-1 must be 0 or more (0 computes every step)."),
        (["cache=first_block", "cache.max_cached=0"], "cache.max_cached=0 must be at least 1, or unset for no cap."),
        (["cache=static", "cache.compute_every=0"], "cache.compute_every=0 must be at least 1."),
        (["cache.name=teacache"], "cache='teacache' is not a known step cache; allowed: none, first_block, static."),
    ],
)
def test_cache_mistakes_are_one_sentence(overrides, message):
    with pytest.raises(ValueError) as err:
        checks.check_run_config(tiny_config(*BASE, *overrides))
    assert str(err.value) == message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cli_runs_a_static_cache_and_refuses_a_bad_mask_in_one_line(tmp_path):
    bad = run(
        ditrun_command(*BASE, "cache=static", "cache.compute_steps=[1,2]", f"hydra.run.dir={tmp_path / 'bad'}"),
        120,
        tmp_path,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "ditrun: error: cache.compute_steps=[1, 2] must hold step 0" in bad.stderr
    good = run(
        ditrun_command(*BASE, "cache=static", "cache.compute_every=3", f"hydra.run.dir={tmp_path / 'good'}"),
        200,
        tmp_path,
    )
    assert good.returncode == 0, good.stderr
    row = next(line.split() for line in good.stdout.splitlines() if line.startswith("astronaut"))
    # The first step, every third from it (1, 4) and the last (4): 3 of 5.
    assert row[2] == "3/5" and records(tmp_path / "good")[0]["cache_computed"]["cond"] == [0, 1, 4]


# ---------------------------------------------------------------------------------------------
# Layouts: 2 and 4 gloo ranks against ``single`` with the same decisions


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["ulysses", "cfg_split"])
def test_adaptive_cache_in_a_layout_equals_single(tmp_path, single_adaptive, layout, world):
    """Each branch decides as ``single``'s does (its statistic summed over the SP group) and ends on its latents."""
    out, single = single_adaptive
    record = run_layout(tmp_path, world, *ADAPTIVE, f"layout={layout}", "layout.head_groups=2")
    for branch, steps in record["cache_computed"].items():  # cfg_split's writer runs the conditional branch only
        assert steps == single["cache_computed"][branch], branch
    assert relative_error(latents(tmp_path, "astronaut"), latents(out, "astronaut")) <= MAX_RELATIVE_ERROR


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_batched_cfg_cache_equals_single_with_its_decisions(tmp_path, world):
    """``cfg_batch`` decides for both branches at once; ``single`` with those steps as a static mask matches it."""
    record = run_layout(tmp_path / "batched", world, *ADAPTIVE, "layout=cfg_batch", "cache.extrapolate=true")
    steps = record["cache_computed"]["both"]
    assert 0 < len(steps) < STEPS and record["steps_computed"] == len(steps)
    mask = f"cache.compute_steps=[{','.join(map(str, steps))}]"
    run_single(tmp_path / "single", "cache=static", mask, "cache.extrapolate=true")
    error = relative_error(latents(tmp_path / "batched", "astronaut"), latents(tmp_path / "single", "astronaut"))
    assert error <= MAX_RELATIVE_ERROR


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ulysses", "cfg_batch", "cfg_split"])
def test_static_cache_with_no_block_in_a_layout_equals_single(tmp_path, layout):
    """``cache.blocks=0``: a cached step runs no block at all; every rank reuses its own tokens' residual."""
    overrides = ["cache=static", "cache.blocks=0", "cache.compute_steps=[0,1,3]", "cache.extrapolate=true"]
    run_single(tmp_path / "single", *overrides)
    record = run_layout(tmp_path / "four", 4, *overrides, f"layout={layout}")
    assert record["steps_computed"] == 3
    assert (
        relative_error(latents(tmp_path / "four", "astronaut"), latents(tmp_path / "single", "astronaut"))
        <= MAX_RELATIVE_ERROR
    )


# ---------------------------------------------------------------------------------------------
# The SP-group reduction


def _decisions(rank, world, layout_name, changes):
    """Each rank's decision from a residual whose change on its own tokens is ``changes[rank]``: summed over the
    SP group (as the cache does), and from its own tokens alone."""
    cfg = tiny_config(f"layout={layout_name}", f"launcher.world={world}")
    layout = build_layout(Placement.on_one_node(plan_layout(cfg.layout, world, 8)))
    previous = torch.ones(1, 3 + rank, 16)  # shards of different lengths, as an uneven split gives
    residual = previous * (1 + changes[rank])
    policy = FirstBlock(CacheConfig(name="first_block", threshold=0.2), STEPS)
    summed = relative_l1(residual, previous, layout.sp_sum)
    alone = relative_l1(residual, previous, lambda t: t)
    return policy.computes(2, summed, 0), policy.computes(2, alone, 0), summed


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sp_group_reduction_makes_every_rank_decide_alike():
    # Rank 0's tokens changed by 0.5, rank 1's by 0.01: alone they would disagree.
    results = run_ranks(_decisions, 2, ("ulysses", [0.5, 0.01]), timeout=90)
    assert [alone for _, alone, _ in results] == [True, False]
    assert [summed for summed, _, _ in results] == [True, True]
    # The token-weighted change over the group: (3 x 0.5 + 4 x 0.01) / 7, the same bits on both ranks.
    assert results[0][2] == results[1][2] == pytest.approx((3 * 0.5 + 4 * 0.01) / 7)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_split_cfg_groups_decide_apart():
    # cfg_split on 4 ranks: SP groups {0, 1} (conditional) and {2, 3} (unconditional).
    results = run_ranks(_decisions, 4, ("cfg_split", [0.5, 0.01, 0.05, 0.01]), timeout=90)
    summed = [decision for decision, _, _ in results]
    assert summed == [True, True, False, False]
    assert results[0][2] == results[1][2] and results[2][2] == results[3][2] != results[0][2]


# ---------------------------------------------------------------------------------------------
# GPU: the parts replayed from CUDA graphs


GPU = ["device=cuda", "model.compile=on", "model.cuda_graphs=on", "workload.width=128", "workload.height=128"]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_graphed_parts_equal_the_graphed_forward_at_threshold_zero(tmp_path):
    """Head and tail each replayed from their own CUDA graphs: bitwise the whole forward's graph."""
    try:
        run_single(tmp_path / "none", *GPU)
        record = run_single(tmp_path / "zero", *GPU, "cache=first_block", "cache.threshold=0")
    finally:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    assert record["steps_computed"] == STEPS
    assert torch.equal(latents(tmp_path / "zero", "astronaut"), latents(tmp_path / "none", "astronaut"))


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_graphed_static_cache_equals_the_eager_one(tmp_path):
    """Cached steps replay the head's graph and finish eagerly; the same mask eager ends on the same latents."""
    mask = ["cache=static", "cache.compute_steps=[0,2]", "cache.extrapolate=true", "model.dtype=fp32"]
    try:
        graphed = run_single(tmp_path / "graphed", *GPU, *mask)
        eager = run_single(tmp_path / "eager", *GPU[:1], "model.compile=off", *GPU[3:], *mask)
    finally:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    assert graphed["cache_computed"] == eager["cache_computed"] == {"cond": [0, 2], "uncond": [0, 2]}
    assert relative_error(latents(tmp_path / "graphed", "astronaut"), latents(tmp_path / "eager", "astronaut")) < 1e-3
