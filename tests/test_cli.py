"""The ``ditrun`` command end to end, in a subprocess, as a user runs it."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from skimage import io

pytestmark = pytest.mark.slow

SMALL = ["workload.width=64", "workload.height=48", "workload.steps=2", "workload.limit=2", "wandb.mode=disabled"]


def ditrun(*args, cwd, timeout=240):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ditrun", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_default_run_writes_images_records_and_summary(tmp_path):
    out = tmp_path / "run"
    proc = ditrun(*SMALL, f"hydra.run.dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "median DiT s/edit" in proc.stdout and "fp32" in proc.stdout  # the CPU says which dtype it used
    records = [json.loads(line) for line in (out / "edits.jsonl").read_text().splitlines()]
    assert [r["edit"] for r in records] == ["astronaut", "coffee"]
    for r in records:
        assert (r["width"], r["height"], r["steps"], r["layout"]) == (64, 48, 2, "single")
        assert len(r["step_s"]) == 2 and r["dit_s"] > 0 and r["exposed_transfer_s"] == 0.0
        image = io.imread(out / r["image"])
        assert image.shape == (48, 64, 3) and np.ptp(image) > 0 and image.std() > 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["model"]["preset"] == "editor"  # the trained editor, with each edit's correct result
    assert all(r["ssim_target"] is not None and r["target"] for r in records)
    assert summary["dit_s_median"] > 0 and summary["images_per_s"] > 0
    assert summary["torch"] and summary["device"]


def test_config_typo_fails_in_hydra_before_work(tmp_path):
    proc = ditrun("workload.stpes=2", cwd=tmp_path)
    assert proc.returncode != 0
    assert "stpes" in proc.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("edits.jsonl"))


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "workload.width=100",
            "edit 'astronaut' has width=100 (workload.width); it must be a positive multiple of 16.",
        ),
        ("model.preset=huge", "model.preset='huge' is unknown; allowed: tiny, small, editor, flux-dev."),
        ("model.path=/nonexistent", "model.path='/nonexistent' is not a folder"),
    ],
)
def test_user_mistakes_are_one_sentence(tmp_path, override, message):
    proc = ditrun(override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2
    assert f"ditrun: error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "a rank must be at least 0 and below the world size"),
        ({"PMI_FD": "987", "PMI_RANK": "0"}, "PMI_FD=987 is set, as MPI's launcher sets it for its ranks"),
    ],
    ids=["rank-beyond-world", "leftover-pmi"],
)
def test_a_launch_environment_that_lies_is_one_sentence_before_any_rendezvous(tmp_path, environ, message):
    proc = subprocess.run(
        [sys.executable, "-m", "ditrun", *SMALL, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MASTER_PORT": "29999", **environ},
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "rendezvous" not in proc.stderr
