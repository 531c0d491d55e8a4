"""Quantized precisions end to end on the CPU (exact emulation), in parallel layouts, against ``single``.

Quantization is per token (activations: one FP8 scale per row, MX blocks along the channels;
INT8-QK attention: one scale per token), so how a layout shards or orders the tokens does not
change it: a layout's latents equal the single process's of the same precision to fp32 rounding.
"""

import json

import pytest
import torch
from launching import (
    MAX_QUANTIZED_RELATIVE_ERROR,
    assert_same_latents,
    ditrun_command,
    latents,
    records,
    relative_error,
    run,
    single_reference,
    tiny_config,
)
from ranks import run_ranks

from ditrun.model.components import LINEAR_COMPONENTS
from ditrun.run import worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """The ``single`` run of each precision, made when first asked for."""
    made = {}

    def get(precision: str):
        if precision not in made:
            made[precision] = single_reference(
                tmp_path_factory.mktemp(precision), f"precision={precision}", "metrics.report=false"
            )
        return made[precision]

    return get


@pytest.mark.timeout(200)
@pytest.mark.parametrize("precision, label", [("fp8", "fp8+fp32"), ("krea", "krea+fp32")])
def test_cli_runs_a_precision_on_two_spawned_ulysses_ranks(tmp_path, singles, precision, label):
    out = tmp_path / "run"
    proc = run(
        ditrun_command(f"precision={precision}", "layout=ulysses", "launcher.world=2", f"hydra.run.dir={out}"),
        180,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"precision {label}" in proc.stdout
    assert_same_latents(out, singles(precision), "ulysses", 2, MAX_QUANTIZED_RELATIVE_ERROR)
    record = records(out)[0]
    assert record["precision"] == label and 0.9 < record["ssim"] < 1.0  # quantized: close to BF16, not equal
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == label and summary["precision_detail"]["mlp"]["backends"] == ["emulation"]


def _run_worker(rank, world, cfg, out_dir):
    return worker.run(cfg, out_dir)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "precision, layout", [("mxfp6", "cfg_batch"), ("mxfp4", "cfg_split"), ("krea", "cfg_split"), ("fp8_all", "ulysses")]
)
def test_precision_in_a_layout_on_two_ranks_equals_single(tmp_path, singles, precision, layout):
    # fp8_all's attention (fp8_pv) scales per call, so a ulysses rank's scales come from its own heads:
    # powers of two, they equal the single process's unless the halves' amax straddle a power of two.
    cfg = tiny_config(f"precision={precision}", f"layout={layout}", "launcher.world=2", "metrics.report=false")
    run_ranks(_run_worker, 2, (cfg, tmp_path), timeout=120)
    assert_same_latents(tmp_path, singles(precision), layout, 2, MAX_QUANTIZED_RELATIVE_ERROR)


GPU = ["device=cuda", "model.dtype=bf16", "metrics.report=false"]


PRECISIONS_ON_GPUS = ["fp8", "fp8_all", "fp8_int8qk", "mxfp6", "mxfp4", "krea"]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", PRECISIONS_ON_GPUS)
def test_precision_runs_on_the_gpu_with_fast_paths(tmp_path, capsys, precision):
    """One GPU: the fast backends run the whole edit, start-up says at most one line about untuned shapes."""
    summary = worker.run(tiny_config(f"precision={precision}", *GPU), tmp_path / "one")
    printed = capsys.readouterr().out
    assert printed.count("no tuned backend") <= 1, printed
    detail = summary["precision_detail"]
    # Hopper runs every quantized linear format fast (bf16 components have no backends); MI300 has no MX path.
    # (the details also hold "attention" and, compiled as GPUs are by default, "compile")
    assert torch.version.hip or all("emulation" not in detail[c]["backends"] for c in LINEAR_COMPONENTS), detail
    if precision == "krea":
        assert detail["attention"]["backends"] == ["triton"]  # the tiny model's heads are not the Gluon kernel's 128
    if precision in ("fp8_all", "fp8_int8qk") and not torch.version.hip:  # the presets' named backend runs here
        assert detail["mlp"]["backends"] == ["fp8_rowwise_fast"], detail
    assert summary["ssim_median"] > 0.9 and summary["precision"] == precision


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", PRECISIONS_ON_GPUS)
def test_precision_in_ulysses_on_two_gpus_equals_one(tmp_path, precision):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    worker.run(tiny_config(f"precision={precision}", *GPU), tmp_path / "one")
    cfg = tiny_config(f"precision={precision}", *GPU, "layout=ulysses", "launcher.world=2")
    run_ranks(_run_worker, 2, (cfg, tmp_path / "two"), timeout=300, backend="nccl")
    for edit in [r["edit"] for r in records(tmp_path / "one")]:
        assert relative_error(latents(tmp_path / "two", edit), latents(tmp_path / "one", edit)) < 5e-2
