"""Helpers for tests that start ``ditrun`` as users do: a command line, a launcher, a results dir.

The workload is one or two tiny edits (32x48 pixels, 2 steps, a model with 8 heads so that
4-way Ulysses is valid), so that process start-up, not the DiT, is what these tests pay for.
They run on the CPU in fp32 even where a GPU is visible (``device=cpu``): the gloo ranks are
forked, and the exactness bound (1e-5) is an fp32 one; GPU runs have tests of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml
from hydra import compose, initialize_config_module
from safetensors.torch import load_file

from ditrun.config import register_configs
from ditrun.results.files import edit_outputs
from ditrun.run import worker

VENV_BIN = Path(sys.executable).parent
TINY = [
    "model=tiny",
    "model.num_attention_heads=8",
    "workload.width=32",
    "workload.height=48",
    "workload.steps=2",
    "workload.text_len=7",
    "workload.limit=1",
    "wandb.mode=disabled",
    "progress=false",
    "device=cpu",
]
MAX_RELATIVE_ERROR = 1e-5
# Quantized runs: layouts run the same rows in batches of other shapes (cfg_batch stacks both CFG
# branches), so compiled kernels may differ by an fp32 ulp, which can move a value across a
# rounding boundary of the quantizer: one quantization step, amplified over the steps. Measured
# 4e-4 (mxfp6, cfg_batch) and 1.7e-3 (krea, ulysses) with true CFG on, 0 with it off; far below
# the quantization error itself (~1e-2 against BF16) but above plain fp32 rounding.
MAX_QUANTIZED_RELATIVE_ERROR = 3e-3


def ditrun_command(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "ditrun", *TINY, *overrides]


def quiet_env(**extra: str) -> dict:
    """The environment for a launched job: unbuffered output, this venv's tools first on PATH."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "PMI_", "OMPI_"))}
    env.update(PYTHONUNBUFFERED="1", PATH=f"{VENV_BIN}:{env.get('PATH', '')}", **extra)
    return env


def run(command: list[str], timeout: float, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=quiet_env(**env))


def tiny_config(*overrides: str):
    """The composed run config of ``TINY`` with ``overrides`` (later ones win)."""
    register_configs()
    with initialize_config_module("ditrun.conf", version_base="1.3"):
        return compose("config", overrides=[*TINY, *overrides])


def single_reference(out_dir: Path, *overrides: str) -> Path:
    """The ``single`` layout's results for the same edits, run in this process."""
    worker.run(tiny_config(*overrides), out_dir)
    return out_dir


SIX = ["astronaut", "camera", "cat", "chelsea", "coffee", "rocket"]


def six_edits(folder: Path) -> Path:
    """A manifest of six photographs, for runs that are interrupted and resumed."""
    manifest = folder / "six.yaml"
    manifest.write_text(yaml.safe_dump([{"id": name, "image": f"skimage:{name}"} for name in SIX]))
    return manifest


def records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "edits.jsonl").read_text().splitlines()]


def relative_error(got, expected) -> float:
    """Largest absolute difference over the largest magnitude of the reference."""
    return ((got - expected).abs().max() / expected.abs().max()).item()


def latents(out_dir: Path, edit: str):
    return load_file(str(out_dir / edit_outputs(edit)["latents"]))["latents"]


def assert_same_latents(
    out_dir: Path, reference: Path, layout: str, world: int, bound: float = MAX_RELATIVE_ERROR
) -> None:
    """Every edit of ``out_dir`` recorded once, by ``layout`` on ``world`` ranks, with the reference's latents."""
    found = records(out_dir)
    expected = [r["edit"] for r in records(reference)]
    assert sorted(r["edit"] for r in found) == sorted(expected)
    for record in found:
        assert (record["layout"], record["world"]) == (layout, world)
        error = relative_error(latents(out_dir, record["edit"]), latents(reference, record["edit"]))
        assert error <= bound, f"{record['edit']}: relative error {error:.2e}"
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["world"] == world and summary["edits"] == len(expected)


def stopped_process(belongs: Callable[[int, list[str]], bool], timeout: float) -> int:
    """The pid of a stopped process (SIGSTOP: ``testing.fault.freeze_rank``) for which ``belongs(pid, fields)`` holds,
    ``fields`` being those of its ``/proc/<pid>/stat`` after the name (state, parent, group, session, ...), once one
    is; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
                fields = stat[stat.rindex(")") + 2 :].split() if stat else []
                if fields and fields[0] == "T" and belongs(int(entry.name), fields):
                    return int(entry.name)
            except OSError:  # the process ended meanwhile
                continue
        time.sleep(0.2)
    raise AssertionError(f"no process stopped itself within {timeout:g} s")
