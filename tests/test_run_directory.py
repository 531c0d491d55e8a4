"""Faults injected into a results directory and the BF16 reference cache, each followed by the real ``ditrun``
command on the CPU: a damaged cache entry is named, discarded and made again; an SSIM above the rerun's is a broken
reference, never a pass; a directory belongs to its first run's settings, and a refused run writes nothing in it
(Hydra's ``.hydra/`` included); a rerun of a prefix of the workload keeps the summary of the whole directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from ditrun_cli import TINY, ditrun
from skimage import io

from ditrun.metrics.full_quality_images import pixel_checksum
from ditrun.results import rundir

COMMON = [*TINY, "wandb.mode=disabled", "progress=false", "metrics.report=false"]
FOUR = "workload.limit=4"  # every edit of the default workload


def run_in(out: Path, refs: Path, *overrides: str, cwd: Path):
    return ditrun(*COMMON, f"metrics.full_quality_dir={refs}", f"hydra.run.dir={out}", *overrides, cwd=cwd)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "edits.jsonl").read_text().splitlines()]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def entries(refs: Path) -> dict[str, Path]:
    """Each cache entry by the edit it holds (the default workload's edits are ``skimage:<id>``)."""
    found = {}
    for sidecar in refs.glob("*/key.json"):
        image = json.loads(sidecar.read_text())["description"]["edit"]["image"]
        found[image.removeprefix("skimage:")] = sidecar.parent
    return found


def snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of the directory with its bytes and modification time, but the lock (its holder writes its name)."""
    return {
        str(path.relative_to(out)): (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(out.rglob("*"))
        if path.is_file() and path.name != rundir.LOCK_FILE
    }


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ditrun: warning: reference cache entry")]


@pytest.fixture(scope="module")
def two_edits(tmp_path_factory) -> Path:
    """A finished run of the default workload's first two edits (astronaut, coffee) without SSIM, made once: each
    test that starts from such a directory reruns or damages a copy of it."""
    base = tmp_path_factory.mktemp("two")
    first = run_in(base / "run", base / "refs", "metrics.ssim=false", cwd=base)
    assert first.returncode == 0, first.stderr
    return base / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_damaged_reference_entries_are_named_discarded_and_made_again(tmp_path):
    refs = tmp_path / "refs"
    first = run_in(tmp_path / "first", refs, FOUR, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    entry = entries(refs)
    assert sorted(entry) == ["astronaut", "chelsea", "coffee", "rocket"]
    original_astronaut = tmp_path / "astronaut-entry"
    shutil.copytree(entry["astronaut"], original_astronaut)
    damaged = {
        "astronaut": entry["astronaut"] / "rerun.png",  # another entry's picture: other pixels
        "coffee": entry["coffee"] / "reference.png",  # truncated
        "chelsea": entry["chelsea"] / "reference.png",  # a picture of another size
        "rocket": entry["rocket"] / "key.json",  # another key's entry under this key's name
    }
    shutil.copyfile(entry["coffee"] / "rerun.png", damaged["astronaut"])
    damaged["coffee"].write_bytes(damaged["coffee"].read_bytes()[:300])
    io.imsave(damaged["chelsea"], np.zeros((48, 48, 3), np.uint8), check_contrast=False)
    shutil.rmtree(entry["rocket"])
    shutil.copytree(original_astronaut, entry["rocket"])

    second = run_in(tmp_path / "second", refs, FOUR, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    found = warnings(second.stderr)
    assert len(found) == 4, second.stderr
    for edit, path in damaged.items():
        assert sum(f"entry {path} " in line for line in found) == 1, (edit, found)
    assert "making the references of 4 edits" in second.stdout
    assert "Traceback" not in second.stderr
    for record in records(tmp_path / "second"):  # remade: a CPU run and its reference are identical
        assert (record["ssim"], record["ssim_rerun"], record["ssim_pct_of_rerun"]) == (1.0, 1.0, 100.0)

    third = run_in(tmp_path / "third", refs, FOUR, cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    assert "the references of all 4 edits come from" in third.stdout and not warnings(third.stderr)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_ssim_above_the_rerun_is_a_broken_reference_never_a_pass(tmp_path):
    """An entry whose files are what its writer wrote (checksums match) but whose rerun is not a rerun of this edit:
    only the measurement shows it."""
    refs = tmp_path / "refs"
    gate = "metrics.min_ssim_pct=99"
    assert run_in(tmp_path / "first", refs, gate, cwd=tmp_path).returncode == 0
    entry = entries(refs)["astronaut"]
    noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    io.imsave(entry / "rerun.png", noise, check_contrast=False)
    sidecar = json.loads((entry / "key.json").read_text())
    sidecar["pixels_sha256"]["rerun.png"] = pixel_checksum(noise)
    (entry / "key.json").write_text(json.dumps(sidecar))

    out = tmp_path / "second"
    broken = run_in(out, refs, gate, cwd=tmp_path)
    assert broken.returncode == 1, broken.stderr
    error = [line for line in broken.stderr.splitlines() if line.startswith("ditrun: error:")]
    assert len(error) == 1 and "ditrun: error: edit 'astronaut' scores" in error[0], broken.stderr
    assert f"above the 101% that two BF16 runs allow, so its cached reference {entry} is broken" in error[0]
    assert "Traceback" not in broken.stderr
    assert not entry.exists()  # discarded
    assert not (out / "edits.jsonl").exists() or "astronaut" not in {r["edit"] for r in records(out)}

    again = run_in(out, refs, gate, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "making the references of 1 edits" in again.stdout
    assert [r["ssim_pct_of_rerun"] for r in records(out)] == [100.0, 100.0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_another_run_in_a_directory_is_refused_naming_the_differences_and_writes_nothing(tmp_path, two_edits):
    out, refs = copy_of(two_edits, tmp_path), tmp_path / "refs"
    before = snapshot(out)
    assert ".hydra/config.yaml" in before and ".hydra/overrides.yaml" in before and rundir.RUN_FILE in before
    manifest = tmp_path / "other.yaml"  # other ids: no edit of the directory's is asked for again
    manifest.write_text(yaml.safe_dump([{"id": name, "image": f"skimage:{name}"} for name in ("camera", "cat")]))
    foreign = run_in(
        out,
        refs,
        "metrics.ssim=false",
        f"workload.manifest={manifest}",
        "model.weights_seed=1",
        "workload.steps=3",
        cwd=tmp_path,
    )
    assert foreign.returncode == 2, foreign.stderr
    assert foreign.stderr.count("ditrun: error:") == 1 and "Traceback" not in foreign.stderr
    assert f"ditrun: error: results directory {out} belongs to a run with other settings (" in foreign.stderr
    for difference in ("model.weights_seed: 0 recorded, 1 now", "workload.steps: 2 recorded, 3 now"):
        assert difference in foreign.stderr
    assert snapshot(out) == before  # no record, no summary, no .hydra file touched

    # The layout is a setting of the directory too (its timings are the layout's).
    other_layout = run_in(out, refs, "metrics.ssim=false", "launcher.world=2", "layout=ulysses", cwd=tmp_path)
    assert other_layout.returncode == 2
    assert "layout.name: single recorded, ulysses now; launcher.world: 1 recorded, 2 now" in other_layout.stderr
    assert snapshot(out) == before

    # What may differ: the prefix of the workload, W&B, timeouts, the cache's place.
    same = run_in(
        out,
        tmp_path / "other-refs",
        "metrics.ssim=false",
        "workload.limit=1",
        "launcher.collective_timeout_s=30",
        cwd=tmp_path,
    )
    assert same.returncode == 0, same.stderr
    assert "resuming, 1 edits already in edits.jsonl are skipped" in same.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_held_directory_keeps_its_hydra_files_and_a_run_writes_its_own(tmp_path):
    """Spawned ranks (rank 0 writes them after its checks) and a multirun's jobs each get their .hydra files."""
    out, refs = tmp_path / "run", tmp_path / "refs"
    first = run_in(out, refs, "launcher.world=2", "layout=ulysses", "metrics.ssim=false", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "launcher.world=2" in yaml.safe_load((out / ".hydra" / "overrides.yaml").read_text())
    assert yaml.safe_load((out / ".hydra" / "config.yaml").read_text())["launcher"]["world"] == 2
    assert yaml.safe_load((out / ".hydra" / "hydra.yaml").read_text())["hydra"]["run"]["dir"] == str(out)
    before = snapshot(out)
    lock = rundir.RunLock(out).acquire()
    try:
        busy = run_in(
            out, refs, "launcher.world=2", "layout=ulysses", "metrics.ssim=false", "workload.limit=1", cwd=tmp_path
        )
    finally:
        lock.release()
    assert busy.returncode == 2 and f"results directory {out} is in use by another ditrun run" in busy.stderr
    assert snapshot(out) == before

    sweep = tmp_path / "sweep"
    multirun = ditrun(
        "-m", *COMMON, "metrics.ssim=false", "workload.steps=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert multirun.returncode == 0, multirun.stderr
    for job, steps in (("0", 1), ("1", 2)):
        assert f"workload.steps={steps}" in yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
        assert yaml.safe_load((sweep / job / ".hydra" / "config.yaml").read_text())["workload"]["steps"] == steps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resumed_runs_first_edit_is_its_warm_up_and_a_rerun_of_a_prefix_keeps_the_whole_summary(tmp_path, two_edits):
    """Each process compiles and warms up on its first edit: after a resume, the medians leave out the first edit of
    every process that wrote some (``metrics.warmup_edits``), not only the directory's first. A rerun of a prefix of
    the workload then appends, and the summary stays the whole directory's."""
    out, refs = copy_of(two_edits, tmp_path), tmp_path / "refs"  # astronaut, coffee
    resumed = run_in(out, refs, FOUR, "metrics.ssim=false", cwd=tmp_path)  # chelsea (its warm-up), rocket
    assert resumed.returncode == 0, resumed.stderr
    done = records(out)
    sessions = [record["session"] for record in done]
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]
    steady = sorted(record["dit_s"] for record in (done[1], done[3]))
    assert summary(out)["dit_s_median"] == pytest.approx(sum(steady) / 2, rel=1e-12)
    assert summary(out)["edits"] == 4 and summary(out)["complete"] is True

    lines = (out / "edits.jsonl").read_text().splitlines()
    (out / "edits.jsonl").write_text("\n".join(lines[:3]) + "\n")  # as if the run had ended after its third edit
    prefix = run_in(out, refs, "workload.limit=2", "metrics.ssim=false", cwd=tmp_path)
    assert prefix.returncode == 0, prefix.stderr
    assert "resuming, 2 edits already in edits.jsonl are skipped" in prefix.stdout
    assert len(records(out)) == 3
    assert (summary(out)["edits"], summary(out)["complete"]) == (3, False)  # the directory's fourth edit is missing

    whole = run_in(out, refs, FOUR, "metrics.ssim=false", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert [r["edit"] for r in records(out)] == ["astronaut", "coffee", "chelsea", "rocket"]
    assert (summary(out)["edits"], summary(out)["complete"]) == (4, True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_directory_without_its_settings_file_is_adopted_and_its_records_still_checked(tmp_path, two_edits):
    """A results directory from before ``run.json`` (or one whose file was deleted) keeps the per-record check."""
    out, refs = copy_of(two_edits, tmp_path), tmp_path / "refs"
    (out / rundir.RUN_FILE).unlink()
    changed = run_in(out, refs, "metrics.ssim=false", "workload.steps=3", cwd=tmp_path)
    assert changed.returncode == 2
    assert (
        "holds edit 'astronaut' made with other settings (steps: 2 recorded, 3 now; reference.steps: 2 recorded, 3 "
        "now)" in changed.stderr
    )
    assert not (out / rundir.RUN_FILE).exists()
    adopted = run_in(out, refs, "metrics.ssim=false", cwd=tmp_path)
    assert adopted.returncode == 0 and "resuming, 2 edits already in edits.jsonl are skipped" in adopted.stdout
    assert json.loads((out / rundir.RUN_FILE).read_text())["edits"] == ["astronaut", "coffee"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_step_cache_is_a_setting_of_the_directory_and_the_quality_measure_is_not(tmp_path, two_edits):
    """A cache key changes the run's results, so another value is a foreign run; ``metrics.quality`` only judges them.
    Under ``cache=none`` the other cache keys change nothing, so they are not the directory's."""
    out, refs = tmp_path / "cached", tmp_path / "refs"
    assert run_in(out, refs, "cache=first_block", "metrics.ssim=false", cwd=tmp_path).returncode == 0
    assert json.loads((out / rundir.RUN_FILE).read_text())["settings"]["cache"]["name"] == "first_block"
    other = run_in(out, refs, "cache=first_block", "cache.threshold=0.2", "metrics.ssim=false", cwd=tmp_path)
    assert other.returncode == 2
    assert "belongs to a run with other settings (cache.threshold: 0.08 recorded, 0.2 now)" in other.stderr
    judged = run_in(out, refs, "cache=first_block", "metrics.quality=bf16", "metrics.ssim=false", cwd=tmp_path)
    assert judged.returncode == 0, judged.stderr
    assert "resuming, 2 edits already in edits.jsonl are skipped" in judged.stdout
    # Without a cache the directory's other cache keys all differ too: the choice that explains them comes first,
    # never behind "(and N more)".
    uncached = run_in(out, refs, "cache=none", "metrics.ssim=false", cwd=tmp_path)
    assert uncached.returncode == 2
    assert "belongs to a run with other settings (cache.name: first_block recorded, none now; " in uncached.stderr

    plain = copy_of(two_edits, tmp_path / "plain")  # a run of cache=none
    unused = run_in(plain, refs, "cache.threshold=0.2", "metrics.ssim=false", cwd=tmp_path)
    assert unused.returncode == 0, unused.stderr
    assert "resuming, 2 edits already in edits.jsonl are skipped" in unused.stdout
