"""The reference image at its own size, diffusers' names and true CFG off, through every layout.

The multi-rank cases use an output of 10 tokens (32x80 pixels) and a reference of 8 (64x32),
with 7 text tokens: over 3 Ulysses ranks output, reference and text all split unevenly
(4/3/3, 3/3/2, 3/2/2), each on its own grid.
"""

import pytest
import torch
from hydra import compose, initialize_config_module
from launching import assert_same_latents, ditrun_command, run, tiny_config
from omegaconf import OmegaConf
from ranks import run_ranks

from ditrun.config import WorkloadConfig, register_configs
from ditrun.metrics.full_quality_images import reference_key
from ditrun.model.latents import LinearLatentMap
from ditrun.model.presets import PRESETS
from ditrun.run import checks, worker
from ditrun.workload.edit import WorkloadError
from ditrun.workload.images import check_sources
from ditrun.workload.inputs import edit_inputs, edit_tokens
from ditrun.workload.manifest import check_config, resolve_edits

UNEVEN = [
    "model=tiny",
    "model.num_attention_heads=6",
    "model.attention_head_dim=32",
    "workload.width=80",
    "workload.height=32",
    "workload.ref_width=64",
    "workload.ref_height=32",
    "metrics.report=false",
]


def _workload(**kw):
    return OmegaConf.merge(OmegaConf.structured(WorkloadConfig), kw)


@pytest.mark.parametrize("rule, size", [("output", (64, 48)), ("none", (512, 512)), ("kontext", (1024, 1024))])
def test_reference_size_rules(rule, size):
    """astronaut is 512x512: ``none`` keeps it, ``kontext`` snaps it to Kontext's square 1 MP."""
    edit = resolve_edits(_workload(edits=[{"image": "skimage:astronaut"}], width=64, height=48, ref_resize=rule))[0]
    assert (edit.ref_width, edit.ref_height) == size
    assert edit_tokens(edit, 7) == 7 + 4 * 3 + (size[0] // 16) * (size[1] // 16)


def test_kontext_rule_picks_the_closest_aspect_ratio_and_none_rounds_down():
    # coffee is 600 wide, 400 high (aspect 1.5): Kontext's closest is 1248x832; none rounds to 592x400.
    kontext, none = (
        resolve_edits(_workload(edits=[{"image": "skimage:coffee"}], ref_resize=rule))[0]
        for rule in ("kontext", "none")
    )
    assert (kontext.ref_width, kontext.ref_height) == (1248, 832)
    assert (none.ref_width, none.ref_height) == (592, 400)


def test_explicit_reference_size_wins_and_ids_lie_on_its_own_grid():
    workload = _workload(
        edits=[{"image": "skimage:coffee", "ref_width": 64, "ref_height": 32}],
        width=48,
        height=32,
        ref_resize="kontext",
        text_len=4,
    )
    edit = resolve_edits(workload)[0]
    inputs = edit_inputs(edit, LinearLatentMap(), PRESETS["tiny"], workload, torch.device("cpu"))
    assert inputs.noise.shape[1] == 3 * 2 and inputs.ref_latents.shape[1] == 4 * 2
    assert inputs.ref_ids[:, 0].eq(1).all() and inputs.ref_ids[:, 1].max() == 1 and inputs.ref_ids[:, 2].max() == 3
    assert inputs.img_ids[:, 0].eq(0).all() and inputs.img_ids[:, 2].max() == 2


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"ref_width": 64}, "edit 'x' sets only one of ref_width and ref_height"),
        ({"ref_width": 40, "ref_height": 32}, "edit 'x' has ref_width=40; it must be a positive multiple of 16."),
    ],
)
def test_bad_reference_sizes_name_the_edit(entry, message):
    with pytest.raises(WorkloadError, match=message):
        resolve_edits(_workload(edits=[{"id": "x", "image": "skimage:coffee", **entry}]))


def test_bad_rules_are_one_sentence():
    with pytest.raises(
        WorkloadError, match="workload.ref_resize='big' is not a reference size rule; allowed: output, kontext, none."
    ):
        check_config(_workload(ref_resize="big"))
    with pytest.raises(WorkloadError, match="workload.true_cfg_scale=nan must be a finite number."):
        check_config(_workload(true_cfg_scale=float("nan")))


def test_cfg_split_without_true_cfg_is_refused():
    with pytest.raises(
        ValueError,
        match="layout=cfg_split runs the unconditional branch on half the ranks, but "
        "workload.true_cfg_scale=1.0 turns true CFG off",
    ):
        checks.check_run_config(tiny_config("layout=cfg_split", "workload.true_cfg_scale=1.0"), 2)


def test_reference_key_has_the_reference_size():
    keys = set()
    for size in ([], ["workload.ref_width=64", "workload.ref_height=32"], ["workload.ref_resize=none"]):
        cfg = tiny_config(*size)
        edit = resolve_edits(cfg.workload)[0]
        keys.add(reference_key(cfg, PRESETS["tiny"], edit, torch.float32, "cpu")[0])
    assert len(keys) == 3


@pytest.fixture(scope="module")
def single_uneven(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    worker.run(tiny_config(*UNEVEN), out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cli_ulysses_on_three_ranks_with_a_smaller_reference_equals_single(tmp_path, single_uneven):
    out = tmp_path / "run"
    proc = run(ditrun_command(*UNEVEN, "layout=ulysses", "launcher.world=3", f"hydra.run.dir={out}"), 140, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_same_latents(out, single_uneven, "ulysses", 3)


def _run_worker(rank, world, cfg, out_dir):
    return worker.run(cfg, out_dir)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["ulysses", "cfg_batch"])
def test_true_cfg_off_layouts_equal_single(tmp_path, layout):
    off = [*UNEVEN, "workload.true_cfg_scale=1.0", "metrics.ssim=false"]
    worker.run(tiny_config(*off), tmp_path / "single")
    run_ranks(
        _run_worker, 2, (tiny_config(*off, f"layout={layout}", "launcher.world=2"), tmp_path / "two"), timeout=120
    )
    assert_same_latents(tmp_path / "two", tmp_path / "single", layout, 2)


def test_benchmark_workload_has_the_published_shape():
    """workload=benchmark: 23 distinct pictures, prompts and seeds, each 4096 reference + 16384 output tokens."""
    cfg = _composed("workload=benchmark")
    edits = resolve_edits(cfg.workload)
    assert len(edits) == 23
    for key in ("image", "prompt", "seed"):
        assert len({getattr(e, key) for e in edits}) == 23, key
    assert {(e.width, e.height, e.ref_width, e.ref_height) for e in edits} == {(2048, 2048, 1024, 1024)}
    assert {edit_tokens(e, cfg.workload.text_len) for e in edits} == {512 + 16384 + 4096}
    check_sources(edits)  # every picture ships with scikit-image (no download)
    assert len(resolve_edits(_composed("workload=benchmark", "workload.limit=2").workload)) == 2


def _composed(*overrides: str):
    """The config a user's command line composes (without the tests' tiny sizes)."""
    register_configs()
    with initialize_config_module("ditrun.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_pipeline_folder_without_text_encoders_is_one_sentence(tmp_path):
    from ditrun.errors import UserError
    from ditrun.model import folders
    from ditrun.workload import prompts

    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text("{}")
    cfg = tiny_config(f"model.path={tmp_path}")
    edits = resolve_edits(cfg.workload)
    assert folders.transformer_folder(str(tmp_path)) == str(tmp_path / "transformer")
    assert folders.vae_folder(str(tmp_path), None) == str(tmp_path / "vae")
    with pytest.raises(
        UserError,
        match="is a pipeline folder without text_encoder/, text_encoder_2/, tokenizer/, "
        "tokenizer_2/; give every edit a prompt_embeds file",
    ):
        prompts.prompt_cache(edits, cfg)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["cfg_batch", "cfg_split"])
def test_cfg_layouts_with_a_smaller_reference_equal_single(tmp_path, single_uneven, layout):
    """True CFG on, reference of another size than the output: both CFG layouts on 2 ranks."""
    run_ranks(_run_worker, 2, (tiny_config(*UNEVEN, f"layout={layout}", "launcher.world=2"), tmp_path), timeout=120)
    assert_same_latents(tmp_path, single_uneven, layout, 2)
