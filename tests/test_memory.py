"""The memory estimate of an edit, and the refusal of one that cannot fit (on the CPU here; on a GPU
through the command, skipped without one)."""

import dataclasses
import os

import pytest
import torch
from ditrun_cli import ditrun

from ditrun.model.memory import (
    GIB,
    MemoryEstimate,
    OutOfMemoryError,
    activation_elements_per_token,
    available_host_bytes,
    check_fits,
    estimate,
    free_bytes,
    parameter_count,
)
from ditrun.model.presets import PRESETS

TINY = PRESETS["tiny"]


def test_parameter_count_is_the_models():
    from ditrun.model.load import random_model

    assert parameter_count(TINY) == sum(p.numel() for p in random_model(TINY).parameters())


def test_estimate_counts_weights_activations_and_the_image_by_layout():
    params = parameter_count(TINY)
    one = estimate(TINY, tokens=1000, pixels=256 * 256, weight_bytes=4, activation_bytes=4, params=params)
    assert one.weights == 4 * params and one.image == 0
    assert one.activations == 1000 * activation_elements_per_token(TINY) * 4
    assert activation_elements_per_token(TINY) == 24 * TINY.inner_dim  # GELU MLP: 8 + 4 x 4 channels' worth
    swiglu = dataclasses.replace(TINY, mlp="swiglu")
    assert activation_elements_per_token(swiglu) == 40 * TINY.inner_dim
    split = estimate(TINY, 1000, 256 * 256, 4, 4, params, ranks_per_sequence=2)
    batched = estimate(TINY, 1000, 256 * 256, 4, 4, params, batch=2)
    host = estimate(TINY, 1000, 256 * 256, 4, 4, params, on_host=True)
    assert split.activations * 2 == one.activations and batched.activations == 2 * one.activations
    assert host.image == 256 * 256 * 3 * 8 * 3 and host.total == one.total + host.image


def test_an_edit_that_cannot_fit_is_refused_naming_it():
    need = MemoryEstimate(weights=GIB, activations=3 * GIB, image=0)
    check_fits("ok", "64x64", 40, need, free=4 * GIB, device=torch.device("cpu"))
    with pytest.raises(
        OutOfMemoryError,
        match=r"edit 'big' \(64x64, 40 tokens\) needs about 4.0 GiB per rank on "
        r"cpu x 2 ranks sharing this machine's memory .* but only 5.0 GiB is free",
    ):
        check_fits("big", "64x64", 40, need, free=5 * GIB, device=torch.device("cpu"), ranks_here=2)


def test_free_memory_of_this_machine_is_positive_and_below_its_total():
    # Two reads of MemAvailable: the other test worker may allocate in between, so they agree within 1 GiB.
    free, available = free_bytes(torch.device("cpu")), available_host_bytes()
    assert 0 < free and abs(free - available) < 2**30
    assert available_host_bytes() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_an_edit_too_large_for_the_gpu_is_refused_before_the_model_is_built(tmp_path):
    # 131072 px square: 134 M tokens, about 800 GiB of activations for the tiny model in bf16.
    proc = ditrun(
        "device=cuda",
        "workload.width=131072",
        "workload.height=131072",
        "workload.limit=1",
        "wandb.mode=disabled",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "ditrun: error: edit 'astronaut' (131072x131072, 134217760 tokens) needs about" in proc.stderr
    assert "on cuda" in proc.stderr and "Traceback" not in proc.stderr and " edits on " not in proc.stdout
