"""Every layout on 2 and 4 gloo ranks gives the ``single`` run's latents, through the real worker.

The workload is tiny on purpose: 32x48 pixels (6 output + 6 reference tokens) and 7 text
tokens, so the joint sequence of 19 tokens divides by neither 2 nor 4 and every shard length
is exercised. The model has 8 heads so that 4 ranks with 2 head groups is a valid layout.
"""

import subprocess
import sys

import pytest
import torch
from launching import assert_same_latents, ditrun_command, latents, records, relative_error, run, tiny_config
from ranks import run_ranks

from ditrun.results import files as results
from ditrun.run import checks, worker

# Two edits, so that two replicas get one each.
TWO_EDITS = ["workload.limit=2", "metrics.report=false"]


def make_config(*overrides: str):
    return tiny_config(*TWO_EDITS, *overrides)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    worker.run(make_config(), out)
    return out


def _run_worker(rank, world, cfg, out_dir):
    return worker.run(cfg, out_dir)


def run_layout(tmp_path, world: int, *overrides: str) -> None:
    cfg = make_config(*overrides, f"launcher.world={world}")
    summaries = run_ranks(_run_worker, world, (cfg, tmp_path), timeout=120)
    assert summaries[0] is not None and all(s is None for s in summaries[1:])  # rank 0 writes the summary


def check_equal_to_single(out_dir, single_run, layout: str, world: int) -> list[dict]:
    """The run in ``out_dir`` recorded each edit once, with the single run's latents; returns its records."""
    assert_same_latents(out_dir, single_run, layout, world)
    found = records(out_dir)
    for record in found:
        # The replica's writer made (or reused) the BF16 single reference: the same image, within rounding.
        assert record["ssim_rerun"] == 1.0 and record["ssim"] > 0.999, record
    return found


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["ulysses", "cfg_batch", "cfg_split"])
@pytest.mark.parametrize("head_groups", [1, 2])
def test_layout_equals_single(tmp_path, single_run, world, layout, head_groups):
    run_layout(tmp_path, world, f"layout={layout}", f"layout.head_groups={head_groups}")
    for record in check_equal_to_single(tmp_path, single_run, layout, world):
        assert record["head_groups"] == head_groups
        # Timings are not asserted (a loaded machine can make any of them anything); only how they relate.
        assert record["exposed_transfer_s"] >= 0
        assert record["exposed_transfer_pct"] == pytest.approx(100 * record["exposed_transfer_s"] / record["dit_s"])


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout, world", [("single", 2), ("ulysses", 4), ("cfg_batch", 4), ("cfg_split", 4)])
def test_replicas_share_the_edits(tmp_path, single_run, layout, world):
    run_layout(tmp_path, world, f"layout={layout}", "layout.replicas=2")
    found = check_equal_to_single(tmp_path, single_run, layout, world)
    assert sorted(r["replica"] for r in found) == [0, 1]  # one edit per replica


@pytest.mark.slow
def test_single_records_no_exposed_transfer(single_run):
    for record in records(single_run):
        assert record["exposed_transfer_s"] == 0.0 and record["exposed_transfer_pct"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ulysses", "cfg_batch"])
def test_one_worker_layouts_equal_single(tmp_path, single_run, layout):
    """The parallel code paths on one process (SP group of one) give the same latents."""
    worker.run(make_config(f"layout={layout}", "layout.head_groups=2"), tmp_path)
    check_equal_to_single(tmp_path, single_run, layout, 1)


# `ditrun ... launcher.world=4` spawns 4 local ranks: a CPU run of each kind of layout, as a user types it.
CLI_LAYOUTS = {
    "cfg_split": ("cfg_split", ["layout=cfg_split"]),
    "ulysses, 2 replicas, 2 head groups": ("ulysses", ["layout=ulysses", "layout.replicas=2", "layout.head_groups=2"]),
}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", CLI_LAYOUTS)
def test_cli_runs_a_layout_on_four_spawned_ranks(tmp_path, single_run, name):
    layout, overrides = CLI_LAYOUTS[name]
    out = tmp_path / "run"
    proc = run(ditrun_command(*TWO_EDITS, *overrides, "launcher.world=4", f"hydra.run.dir={out}"), 180, tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    assert table["edit"][:5] == ["edit", "size", "steps", "DiT", "s"]
    for record in check_equal_to_single(out, single_run, layout, 4):  # each edit's time is reported
        assert table[record["edit"]][1:4] == ["32x48", "2", f"{record['dit_s']:.3f}"]


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["layout=cfg_split"],
            3,
            "layout=cfg_split needs an even number of workers per replica, but launcher.world=3 / "
            "layout.replicas=1 = 3; allowed launcher.world: multiples of 2.",
        ),
        (
            ["layout=ulysses"],
            3,
            "model.num_attention_heads=8 is not divisible by the Ulysses degree 3 (layout=ulysses, "
            "launcher.world=3, layout.replicas=1); allowed launcher.world: 1, 2, 4, 8.",
        ),
        (
            ["layout=cfg_split", "model.num_attention_heads=6", "model.attention_head_dim=32"],
            8,
            "model.num_attention_heads=6 is not divisible by the Ulysses degree 4 (layout=cfg_split, launcher.world=8, "
            "layout.replicas=1); allowed launcher.world: 2, 4, 6, 12.",
        ),
        (
            ["layout=ulysses", "layout.replicas=2"],
            3,
            "launcher.world=3 is not a multiple of layout.replicas=2; "
            "allowed launcher.world: multiples of 2 (replicas x workers per replica).",
        ),
        (
            ["layout=single"],
            2,
            "layout=single runs one worker per replica, so launcher.world=2 must equal "
            "layout.replicas=1; use layout=ulysses, cfg_batch or cfg_split for more workers per replica.",
        ),
        (
            ["layout=ulysses", "layout.head_groups=3"],
            2,
            "layout.head_groups=3 must divide the 4 heads per worker "
            "(model.num_attention_heads=8 / Ulysses degree 2); allowed: 1, 2, 4.",
        ),
        (
            ["layout.head_groups=2"],
            1,
            "layout.head_groups=2 overlaps exchanges that layout=single does not have; allowed with layout=single: 1.",
        ),
        (
            ["layout.name=ring"],
            1,
            "layout='ring' is not a known layout; allowed: single, ulysses, cfg_batch, cfg_split.",
        ),
        (["layout.replicas=0"], 1, "layout.replicas=0 must be a positive integer."),
        (["layout=ulysses"], 0, "launcher.world=0 must be a positive integer."),
    ],
)
def test_bad_combinations_are_one_sentence(overrides, world, message):
    with pytest.raises(ValueError) as err:
        checks.check_run_config(make_config(*overrides), world)
    assert str(err.value) == message


def _run_and_report(rank, world, cfg, out_dir):
    try:
        worker.run(cfg, out_dir)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_every_rank_refuses_a_bad_layout_before_building_anything(tmp_path):
    cfg = make_config("layout=ulysses", "model.num_attention_heads=3", "launcher.world=2")
    messages = run_ranks(_run_and_report, 2, (cfg, tmp_path), timeout=40)
    assert messages == [messages[0]] * 2 and messages[0].startswith("model.num_attention_heads=3 is not divisible")
    assert not (tmp_path / results.EDITS_FILE).exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_reports_a_bad_layout_as_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ditrun", "layout=cfg_split", "launcher.world=3", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 2
    assert "ditrun: error: layout=cfg_split needs an even number of workers per replica" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ulysses", "cfg_batch", "cfg_split"])
def test_layouts_on_two_gpus_equal_one_gpu(tmp_path, layout):
    """NCCL on two GPUs against one GPU, fp32. Looser than on CPUs: GPU attention kernels pick
    their tiling by sequence length, so sharded and whole sequences round differently."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    common = ("device=cuda", "model.dtype=fp32")
    run_ranks(_run_worker, 1, (make_config(*common), tmp_path / "one"), timeout=240, backend="nccl")
    cfg = make_config(*common, f"layout={layout}", "layout.head_groups=2", "launcher.world=2")
    run_ranks(_run_worker, 2, (cfg, tmp_path / "two"), timeout=240, backend="nccl")
    for edit in ("astronaut", "coffee"):
        assert relative_error(latents(tmp_path / "two", edit), latents(tmp_path / "one", edit)) <= 1e-4
