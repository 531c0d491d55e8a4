"""``benchmarks/scaling.py`` on the committed inputs and on real tiny CPU runs: what the model must hold.

No timing is asserted: the properties are those of the model's arithmetic (latency per edit does
not grow with replicas, 23 edits stop getting faster past 23 replicas, steady throughput is linear
in nodes) and that every cell marked measured is the measured input itself. The run directories
come from the real worker on forked gloo ranks: one (``single``) and two
(``ulysses``), the tiny model, two edits (the first is the warm-up), two steps.
"""

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launching import tiny_config
from ranks import run_ranks

from ditrun.run import worker

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "scaling.py"
MEASURED = ROOT / "benchmarks" / "results" / "measured.json"
RUN = ["workload.limit=2", "metrics.ssim=false", "metrics.report=false"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name; scaling.py imports scaling_model
    spec.loader.exec_module(module)
    return module


scaling_model = load_script("scaling_model")
scaling = load_script("scaling")


def run_script(tmp_path, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "model.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done


def _run_worker(rank, world, cfg, out_dir):
    return worker.run(cfg, out_dir)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """A 1-rank ``single`` and a 2-rank ``ulysses`` run directory of the same tiny edits."""
    # Forked ranks, the single one too: one intra-op thread each, as on a loaded 2-core machine.
    single = tmp_path_factory.mktemp("single")
    run_ranks(_run_worker, 1, (tiny_config(*RUN), single), timeout=90)
    ulysses = tmp_path_factory.mktemp("ulysses")
    run_ranks(_run_worker, 2, (tiny_config(*RUN, "layout=ulysses", "launcher.world=2"), ulysses), timeout=90)
    return single, ulysses


def cells_of(model: dict, device: str = None) -> list[tuple[dict, dict]]:
    return [(s, c) for s in model["scenarios"] if device in (None, s["device"]) for c in s["cells"]]


def check_properties(model: dict) -> None:
    assert cells_of(model)
    for _scenario, cell in cells_of(model):
        nodes = {int(n): v for n, v in cell["nodes"].items()}
        one = nodes[1]
        for n, at in nodes.items():
            assert at["replicas"] == n * 8 // cell["gpus"]
            # A full round of edits, one per replica, takes one edit's latency at any node count.
            assert at["round_s"] == pytest.approx(cell["latency_s"], rel=1e-12)
            # Steady throughput (start-up excluded) is linear in nodes.
            assert at["throughput"] == pytest.approx(n * one["throughput"], rel=1e-12)
            assert at["throughput"] == pytest.approx(at["replicas"] / cell["latency_s"], rel=1e-12)
        by_replicas = sorted(nodes.values(), key=lambda v: v["replicas"])
        for fewer, more in zip(by_replicas, by_replicas[1:]):
            for edits in ("23", "10000"):
                assert more["makespan_compute_s"][edits] <= fewer["makespan_compute_s"][edits] + 1e-9
        # 23 edits: one round once there are 23 replicas; more nodes change nothing but the start-up.
        flat = [v["makespan_compute_s"]["23"] for v in by_replicas if v["replicas"] >= 23]
        assert all(value == pytest.approx(cell["latency_s"], rel=1e-12) for value in flat)
        for at in nodes.values():
            assert at["makespan_s"]["23"] == pytest.approx(at["startup_s"] + at["makespan_compute_s"]["23"])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_committed_inputs_give_the_properties_and_reproduce_the_measured_points(tmp_path):
    model, done = run_script(tmp_path, "--no-default-runs")
    check_properties(model)
    points = json.loads(MEASURED.read_text())["points"]
    marked = [(s, c) for s, c in cells_of(model) if c["measured"]]
    assert marked, "the committed inputs hold measured cells"
    for scenario, cell in marked:
        shape = scenario["shape"]
        same = [
            p
            for p in points
            if (p["layout"], p["gpus"], p["head_groups"], p["precision"], p["true_cfg"])
            == (cell["layout"], cell["gpus"], cell["head_groups"], cell["precision"], shape["true_cfg"])
            and scaling_model.image_tokens(*p["out"]) == shape["out_tokens"]
        ]
        assert len(same) == 1, (scenario["name"], cell)
        point = same[0]
        assert cell["step_s"] == point["dit_s"] / point["steps"]
        exposed_s = point["dit_s"] * point["exposed_transfer_pct"] / 100
        assert cell["exposed_step_s"] == pytest.approx(exposed_s / point["steps"], rel=1e-12)
        if scenario["steps"] == point["steps"]:
            assert cell["latency_s"] == pytest.approx(point["dit_s"], rel=1e-12)
    assert "### published Kontext workload" in done.stdout and "**31.9 M**" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_tiny_cpu_runs_feed_a_scenario_of_their_own(tmp_path, tiny_runs):
    single, ulysses = tiny_runs
    model, done = run_script(tmp_path, "--no-default-runs", str(single), str(ulysses))
    check_properties(model)
    summaries = {
        s["config"]["layout"]["name"]: s for s in (json.loads((d / "summary.json").read_text()) for d in tiny_runs)
    }
    device = summaries["single"]["device"]
    cells = {(c["layout"], c["gpus"]): c for _, c in cells_of(model, device)}
    # Measured: exactly the runs' medians; modelled from them: Ulysses on 4 and 8 GPUs.
    for layout, gpus in (("single", 1), ("ulysses", 2)):
        cell, summary = cells[(layout, gpus)], summaries[layout]
        assert cell["measured"] and cell["precision"] == summary["precision"]
        assert cell["latency_s"] == pytest.approx(summary["dit_s_median"], rel=1e-12)
        steps = summary["config"]["workload"]["steps"]
        assert cell["exposed_step_s"] == pytest.approx(summary["exposed_transfer_s_median"] / steps, rel=1e-12)
    for gpus in (4, 8):
        assert not cells[("ulysses", gpus)]["measured"] and cells[("ulysses", gpus)]["sp_degree"] == gpus
    assert f"measured runs on {device}" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_encode_and_decode_count_only_where_real_vae_weights_ran(tmp_path, tiny_runs):
    single = tiny_runs[0]
    summary = json.loads((single / "summary.json").read_text())
    with_vae = tmp_path / "with_vae"
    shutil.copytree(single, with_vae)
    lines = [json.loads(line) for line in (with_vae / "edits.jsonl").read_text().splitlines()]
    for record in lines:
        record["settings"]["vae"] = "a VAE's fingerprint"  # as a run with workload.vae_path records it
    (with_vae / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    measured = summary["encode_s_median"] + summary["decode_s_median"]
    for run_dir, fixed in ((single, None), (with_vae, measured)):
        model, scenarios = scaling.build(run_dirs=[run_dir])
        scenario = next(s for s in scenarios if s.device == summary["device"])
        assert model.fixed_s(scenario) == fixed
        cell = model.cell(scenario, "single", 1, summary["precision"])
        assert model.latency_s(scenario, cell) == pytest.approx(summary["dit_s_median"] + (fixed or 0.0), rel=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_startup_file_is_fitted_and_its_absence_is_said(tmp_path):
    missing, done = run_script(tmp_path, "--no-default-runs", "--startup", str(tmp_path / "none.json"))
    assert "missing" in done.stderr and any("missing: assumed" in a for a in missing["assumptions"])
    points = [{"nodes": n, "ranks": 2 * n, "startup_s_max": 3.0 + 0.5 * n} for n in (1, 2, 4)]
    (tmp_path / "startup.json").write_text(json.dumps({"device": "test", "points": points}))
    fitted = scaling_model.load_startup(tmp_path / "startup.json")
    for point in points:
        assert fitted.seconds(point["nodes"]) == pytest.approx(point["startup_s_max"], rel=1e-12)
    assert fitted.seconds(64) == pytest.approx(3.0 + 0.5 * 64, rel=1e-12)


@pytest.mark.slow
def test_emulated_nodes_start_up_grows_by_the_rendezvous_cost_per_rank_only(tmp_path):
    """Emulated nodes share one machine's cores: only one node's start-up and the store's cost per rank
    carry over to a real cluster."""
    rows = [{"nodes": n, "ranks": 2 * n, "startup_s_max": 5.0 * n} for n in (1, 2, 4)]
    meeting = {"fixed_s": 0.04, "per_rank_s": 0.0005, "ranks": 512}
    (tmp_path / "startup.json").write_text(
        json.dumps({"machine": "2 CPU cores, emulated nodes", "rows": rows, "fits": {"store_meeting_s": meeting}})
    )
    fitted = scaling_model.load_startup(tmp_path / "startup.json")
    assert fitted.seconds(1) == pytest.approx(5.0, rel=1e-12)
    assert fitted.seconds(64) - fitted.seconds(1) == pytest.approx(63 * 8 * 0.0005, rel=1e-9)


def test_write_docs_replaces_only_what_lies_between_the_markers(tmp_path):
    doc = tmp_path / "SCALING.md"
    doc.write_text(f"before\n{scaling.BEGIN_MARK}\nold\n{scaling.END_MARK}\nafter\n")
    scaling.write_docs("new table", doc)
    assert doc.read_text() == f"before\n{scaling.BEGIN_MARK}\nnew table\n{scaling.END_MARK}\nafter\n"


@pytest.mark.timeout(60)
def test_docs_hold_the_tables_the_committed_inputs_give():
    """docs/SCALING.md's tables are generated: after new inputs, run ``python3 benchmarks/scaling.py --write-docs``."""
    expected = scaling.render(*scaling.build())
    doc = scaling.DOC_FILE.read_text()
    generated = doc.split(scaling.BEGIN_MARK + "\n", 1)[1].split("\n" + scaling.END_MARK, 1)[0]
    assert generated == expected, "docs/SCALING.md is stale: run python3 benchmarks/scaling.py --write-docs"


def test_head_groups_follow_layout_validation():
    # 24 heads: 12 per rank at P = 2 (2 groups valid), 3 per rank at P = 8 (2 is not: 3 is the next divisor).
    assert scaling_model.valid_head_groups(2, 24, 2) == 2
    assert scaling_model.valid_head_groups(2, 24, 8) == 3
    assert scaling_model.valid_head_groups(1, 24, 8) == 1
    assert not math.isnan(scaling_model.fit_link(json.loads(MEASURED.read_text())["alltoall"]).gb_per_s)
