"""ditrun's edit against diffusers' own FluxKontextPipeline: same tiny random transformer, VAE and
embeddings, same seed, no latents passed in. A reference smaller than a non-square output, true
CFG on and off, the guidance embedding on and off: the final latents agree in fp32."""

import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import save_file

diffusers = pytest.importorskip("diffusers")

from launching import relative_error  # noqa: E402

from ditrun.config import WorkloadConfig  # noqa: E402
from ditrun.model import autoencoder, from_pretrained  # noqa: E402
from ditrun.model.latents import DiffusersVAE  # noqa: E402
from ditrun.model.load import checkpoint_geometry  # noqa: E402
from ditrun.model.sampler import denoise, sequential_cfg_velocity  # noqa: E402
from ditrun.workload.inputs import edit_inputs  # noqa: E402
from ditrun.workload.manifest import resolve_edits  # noqa: E402

WIDTH, HEIGHT, REF = 64, 48, 32  # output 4x3 tokens, reference 2x2 tokens
STEPS, SEED, TEXT = 3, 1234, 5


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _transformer(guidance_embeds: bool):
    model = diffusers.FluxTransformer2DModel(
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=24,
        pooled_projection_dim=12,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=[4, 6, 6],
    ).eval()
    _randomise(model, seed=1)
    return model


def _vae():
    # Four blocks: diffusers' vae_scale_factor is 2 ** (blocks - 1) = 8, as Flux's.
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8,) * 4,
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
    _randomise(vae, seed=2)
    return vae


def _embeddings(path) -> dict:
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "prompt_embeds": torch.randn(1, TEXT, 24, generator=gen),
        "pooled_prompt_embeds": torch.randn(1, 12, generator=gen),
        "negative_prompt_embeds": torch.randn(1, TEXT, 24, generator=gen),
        "negative_pooled_prompt_embeds": torch.randn(1, 12, generator=gen),
    }
    save_file(tensors, path)
    return tensors


def _diffusers_latents(transformer, vae, image, embeds, true_cfg_scale, guidance_scale, steps=STEPS):
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    pipe = diffusers.FluxKontextPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(
            image=image,
            height=HEIGHT,
            width=WIDTH,
            max_area=WIDTH * HEIGHT,
            num_inference_steps=steps,
            true_cfg_scale=true_cfg_scale,
            guidance_scale=guidance_scale,
            _auto_resize=False,
            generator=torch.Generator().manual_seed(SEED),
            output_type="latent",
            **embeds,
        ).images


def _ditrun_latents(transformer_dir, vae_dir, image_file, embeds_file, true_cfg_scale, guidance_scale):
    workload = OmegaConf.merge(
        OmegaConf.structured(WorkloadConfig),
        {
            "edits": [{"id": "e", "image": str(image_file), "prompt_embeds": str(embeds_file), "seed": SEED}],
            "width": WIDTH,
            "height": HEIGHT,
            "steps": STEPS,
            "ref_resize": "none",
            "true_cfg_scale": true_cfg_scale,
            "guidance_scale": guidance_scale,
        },
    )
    edit = resolve_edits(workload)[0]
    assert (edit.ref_width, edit.ref_height) == (REF, REF)
    geometry = checkpoint_geometry(transformer_dir)
    cpu = torch.device("cpu")
    model, codec = from_pretrained(transformer_dir), DiffusersVAE(str(vae_dir), cpu, torch.float32)
    inputs = edit_inputs(edit, codec, geometry, workload, cpu, torch.float32)
    assert inputs.true_cfg == (true_cfg_scale > 1)
    guidance = guidance_scale if geometry.guidance_embeds else None
    with torch.no_grad():
        return denoise(
            sequential_cfg_velocity(model, inputs, true_cfg_scale, guidance, torch.float32), inputs.noise, STEPS
        )


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("guidance_embeds", [True, False], ids=["guidance-embed", "no-guidance-embed"])
@pytest.mark.parametrize("true_cfg_scale", [3.0, 1.0], ids=["true-cfg", "no-true-cfg"])
def test_final_latents_equal_diffusers_kontext(tmp_path, guidance_embeds, true_cfg_scale):
    transformer, vae = _transformer(guidance_embeds), _vae()
    transformer.save_pretrained(tmp_path / "transformer", safe_serialization=True)
    vae.save_pretrained(tmp_path / "vae", safe_serialization=True)
    pixels = (np.random.default_rng(4).random((REF, REF, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "ref.png")
    embeds = _embeddings(tmp_path / "embeds.safetensors")

    expected = _diffusers_latents(transformer, vae, Image.open(tmp_path / "ref.png"), embeds, true_cfg_scale, 2.0)
    got = _ditrun_latents(
        tmp_path / "transformer",
        tmp_path / "vae",
        tmp_path / "ref.png",
        tmp_path / "embeds.safetensors",
        true_cfg_scale,
        2.0,
    )
    assert got.shape == expected.shape == (1, (WIDTH // 16) * (HEIGHT // 16), 64)
    assert relative_error(got, expected) <= 1e-4


@pytest.mark.parametrize("flux", [True, False], ids=["flux-kind", "attention-and-quant-convs"])
def test_ditruns_autoencoder_equals_diffusers(tmp_path, flux):
    """ditrun's own forward of an AutoencoderKL folder, as diffusers wrote it: FLUX.1's kind (no quant convs) and
    the other (quant convs; both with the middle block's attention), the posterior's mode and the decoded pixels."""
    vae = diffusers.AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=2,
        latent_channels=4,
        norm_num_groups=4,
        use_quant_conv=not flux,
        use_post_quant_conv=not flux,
    ).eval()
    _randomise(vae, seed=5)
    vae.save_pretrained(tmp_path / "vae", safe_serialization=True)
    config = autoencoder.read_config(tmp_path / "vae")
    assert autoencoder.supports(config) and config["mid_block_add_attention"]
    ours = autoencoder.load(tmp_path / "vae", config, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(6)
    x, z = torch.rand(2, 3, 24, 40, generator=gen) * 2 - 1, torch.randn(2, 4, 6, 10, generator=gen)
    with torch.no_grad():
        assert relative_error(ours.encode_mode(x), vae.encode(x).latent_dist.mode()) <= 1e-5
        assert relative_error(ours.decode(z), vae.decode(z).sample) <= 1e-5
    assert not autoencoder.supports({**config, "up_block_types": ["UpDecoderBlock2D", "AttnUpDecoderBlock2D"]})


def _clip_tokenizer(folder):
    """A hand-written CLIP BPE vocabulary: the specials and single letters (no merges)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        vocab.update({c + suffix: len(vocab) for c in string.ascii_lowercase})
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(
        vocab_file=str(folder / "vocab.json"), merges_file=str(folder / "merges.txt"), model_max_length=77
    )


def _t5_tokenizer():
    """A hand-written T5 unigram vocabulary: the specials, then letters at the start of a word and inside one."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + c, -1.0) for c in string.ascii_lowercase] + [(c, -2.0) for c in string.ascii_lowercase]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def _pipeline_folder(folder, guidance_embeds: bool):
    """A whole tiny FLUX.1 Kontext pipeline in diffusers' layout (widths: T5 24 = joint, CLIP 12 = pooled)."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(5)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=60,
            hidden_size=12,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    ).eval()
    t5 = T5EncoderModel(T5Config(vocab_size=60, d_model=24, d_kv=8, d_ff=32, num_layers=1, num_heads=3)).eval()
    pipe = diffusers.FluxKontextPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
        ),
        vae=_vae(),
        text_encoder=clip,
        tokenizer=_clip_tokenizer(folder.parent / "clip_vocab"),
        text_encoder_2=t5,
        tokenizer_2=_t5_tokenizer(),
        transformer=_transformer(guidance_embeds),
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _diffusers_edit_latents(tmp_path: Path, **call) -> torch.Tensor:
    """diffusers' final latents of "make it red" on a random picture (``tmp_path / "r.png"``), true CFG 2, with a
    pipeline folder written to ``tmp_path / "kontext"`` (``_pipeline_folder``); ``call``: more arguments."""
    pipe = _pipeline_folder(tmp_path / "kontext", guidance_embeds=True)
    Image.fromarray((np.random.default_rng(4).random((REF, REF, 3)) * 255).astype(np.uint8)).save(tmp_path / "r.png")
    with torch.no_grad():
        return pipe(
            image=Image.open(tmp_path / "r.png"),
            prompt="make it red",
            negative_prompt="",
            height=HEIGHT,
            width=WIDTH,
            max_area=WIDTH * HEIGHT,
            num_inference_steps=STEPS,
            true_cfg_scale=2.0,
            guidance_scale=2.0,
            _auto_resize=False,
            generator=torch.Generator().manual_seed(SEED),
            output_type="latent",
            **call,
        ).images


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pipeline_folder_encodes_prompts_as_diffusers_does(tmp_path):
    """model.path = a whole pipeline folder: the prompt and the negative "" are encoded once by its
    encoders (cached on disk); the edit's final latents equal diffusers' run from the prompt text."""
    from launching import latents, tiny_config

    from ditrun.run import worker

    expected = _diffusers_edit_latents(tmp_path, max_sequence_length=TEXT)
    cache = tmp_path / "prompts"
    overrides = _pipeline_overrides(tmp_path, cache)
    worker.run(tiny_config(*overrides), tmp_path / "run")
    assert relative_error(latents(tmp_path / "run", "e"), expected) <= 1e-4
    encoded = sorted(p.name for p in cache.glob("*.safetensors"))
    assert len(encoded) == 3  # the prompt, "" and the pair of them an edit reads
    worker.run(tiny_config(*overrides), tmp_path / "again")  # from the cache: nothing is encoded again
    assert sorted(p.name for p in cache.glob("*.safetensors")) == encoded
    assert torch.equal(latents(tmp_path / "again", "e"), latents(tmp_path / "run", "e"))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_unset_text_len_is_the_folders_and_gives_diffusers_default_run(tmp_path):
    """The command without ``workload.text_len`` on a FLUX.1-style folder (its T5 tokenizer says 512, as FLUX.1's
    do): the prompts are encoded at 512 tokens, diffusers' default ``max_sequence_length``, so the edit's final
    latents are those of diffusers' call that leaves it out; the run's config says the length and where it came
    from."""
    from ditrun_cli import ditrun
    from launching import latents

    expected = _diffusers_edit_latents(tmp_path)  # max_sequence_length left to diffusers
    overrides = [
        key for key in _pipeline_overrides(tmp_path, tmp_path / "prompts") if not key.startswith("workload.text_len")
    ]
    out = tmp_path / "run"
    proc = ditrun(
        "model=tiny",
        "device=cpu",
        "wandb.mode=disabled",
        "progress=false",
        *overrides,
        f"hydra.run.dir={out}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert relative_error(latents(out, "e"), expected) <= 1e-4
    workload = json.loads((out / "summary.json").read_text())["config"]["workload"]
    assert workload["text_len"] == 512
    tokenizer = tmp_path / "kontext" / "tokenizer_2" / "tokenizer_config.json"
    assert workload["text_len_from"] == f"{tokenizer} (model_max_length)"
    assert "at 512 tokens (" in proc.stdout


def test_the_text_length_belongs_to_the_model(tmp_path):
    """``model.folders.model_text_len``: the editor's folder records the 32 tokens it was trained with; a folder whose
    tokenizer names no usable length takes diffusers' 512; without a pipeline folder, the stand-ins' 32."""
    from ditrun.editor import FOLDER
    from ditrun.model.folders import model_text_len
    from recipes.editor.config import TrainConfig

    assert model_text_len(str(FOLDER)) == (
        TrainConfig().text_len,
        f"{FOLDER / 'tokenizer_2'}/tokenizer_config.json (model_max_length)",
    )
    folder = tmp_path / "flux"
    (folder / "transformer").mkdir(parents=True)
    (folder / "tokenizer_2").mkdir()
    (folder / "model_index.json").write_text("{}")
    (folder / "tokenizer_2" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 10**30}))
    assert model_text_len(str(folder)) == (512, "diffusers' max_sequence_length default")
    assert model_text_len(None)[0] == model_text_len(str(folder / "transformer"))[0] == 32


def _pipeline_overrides(tmp_path, cache) -> list[str]:
    return [
        f"model.path={tmp_path / 'kontext'}",
        f"workload.prompt_cache_dir={cache}",
        "metrics.ssim=false",
        f"workload.width={WIDTH}",
        f"workload.height={HEIGHT}",
        f"workload.steps={STEPS}",
        f"workload.text_len={TEXT}",
        "workload.ref_resize=none",
        "workload.true_cfg_scale=2.0",
        "workload.guidance_scale=2.0",
        "metrics.report=false",
        f"workload.edits=[{{id: e, image: '{tmp_path / 'r.png'}', prompt: make it red, seed: {SEED}}}]",
    ]


def _run_with_own_cache(rank, world, tmp_path):
    """Each rank with a prompt cache of its own, as on nodes without a shared file system."""
    from launching import tiny_config

    from ditrun.run import worker

    cache = tmp_path / f"prompts{rank}"
    return worker.run(
        tiny_config(*_pipeline_overrides(tmp_path, cache), "layout=ulysses", "launcher.world=2"), tmp_path / "two"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pipeline_prompts_are_encoded_on_rank_0_and_sent_to_the_others(tmp_path):
    from launching import latents, tiny_config
    from ranks import run_ranks

    from ditrun.run import worker

    _pipeline_folder(tmp_path / "kontext", guidance_embeds=False)
    Image.fromarray((np.random.default_rng(4).random((REF, REF, 3)) * 255).astype(np.uint8)).save(tmp_path / "r.png")
    worker.run(tiny_config(*_pipeline_overrides(tmp_path, tmp_path / "single_cache")), tmp_path / "one")
    run_ranks(_run_with_own_cache, 2, (tmp_path,), timeout=100)
    names = [sorted(p.name for p in (tmp_path / f"prompts{rank}").glob("*.safetensors")) for rank in (0, 1)]
    assert names[0] == names[1] and len(names[0]) == 3
    assert relative_error(latents(tmp_path / "two", "e"), latents(tmp_path / "one", "e")) <= 1e-5


CACHE_STEPS = 10


def _diffusers_cached_latents(transformer, vae, image, embeds, threshold):
    """diffusers' own first-block cache (``FirstBlockCacheConfig``) on the Kontext pipeline, and the steps whose
    remaining blocks ran. The Kontext pipeline sets no cache context of its own (FluxPipeline sets "cond"), so
    each transformer call here runs in the "cond" one, as FluxPipeline's conditional branch does."""
    from diffusers.hooks import FirstBlockCacheConfig

    transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    computed, step = [], [0]
    # The hook replaces the tail block's forward on cached steps, so its norm (inside that forward) runs only on
    # computed ones.
    transformer.single_transformer_blocks[-1].norm.register_forward_pre_hook(lambda *_: computed.append(step[0]))
    forward = transformer.forward

    def in_context(*args, **kwargs):
        with transformer.cache_context("cond"):
            out = forward(*args, **kwargs)
        step[0] += 1
        return out

    transformer.forward = in_context
    try:
        latents = _diffusers_latents(transformer, vae, image, embeds, 1.0, 2.0, CACHE_STEPS)
    finally:
        transformer.forward = forward
        transformer.disable_cache()
    return latents, computed


def _ditrun_cached_latents(transformer_dir, vae_dir, image_file, embeds_file, threshold):
    from ditrun.cache import StepCache
    from ditrun.config import CacheConfig
    from ditrun.model.build import ModelParts
    from ditrun.model.sampler import sequential_branches

    workload = OmegaConf.merge(
        OmegaConf.structured(WorkloadConfig),
        {
            "edits": [{"id": "e", "image": str(image_file), "prompt_embeds": str(embeds_file), "seed": SEED}],
            **{"width": WIDTH, "height": HEIGHT, "steps": CACHE_STEPS, "ref_resize": "none"},
            **{"true_cfg_scale": 1.0, "guidance_scale": 2.0},
        },
    )
    edit = resolve_edits(workload)[0]
    cpu = torch.device("cpu")
    model, codec = from_pretrained(transformer_dir), DiffusersVAE(str(vae_dir), cpu, torch.float32)
    inputs = edit_inputs(edit, codec, checkpoint_geometry(transformer_dir), workload, cpu, torch.float32)
    cache_cfg = OmegaConf.structured(CacheConfig(name="first_block", blocks=1, threshold=threshold, warmup_steps=1))
    step_cache = StepCache(cache_cfg, CACHE_STEPS, model, ModelParts(model.head, model.tail, model.finish), lambda t: t)
    with torch.no_grad():
        velocity = sequential_branches(step_cache, inputs, 1.0, 2.0, torch.float32)
        latents = denoise(velocity, inputs.noise, CACHE_STEPS)
    return latents, step_cache.states["cond"].computed


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_first_block_cache_equals_diffusers_first_block_cache(tmp_path):
    """``cache=first_block`` is diffusers' ``FirstBlockCacheConfig`` under ditrun's names (``cache.threshold`` is its
    ``threshold``, one first block, the first step computed): on the same seeded model and edit, the same steps
    compute and the final latents agree in fp32, at thresholds that cache no step, some steps and most."""
    transformer, vae = _transformer(guidance_embeds=True), _vae()
    transformer.save_pretrained(tmp_path / "transformer", safe_serialization=True)
    vae.save_pretrained(tmp_path / "vae", safe_serialization=True)
    pixels = (np.random.default_rng(4).random((REF, REF, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "ref.png")
    embeds = _embeddings(tmp_path / "embeds.safetensors")
    cached = []
    for threshold in (0.0, 0.7, 1.0):  # on this model: no step cached, 2 of 10, 7 of 10
        expected, diffusers_computed = _diffusers_cached_latents(
            transformer, vae, Image.open(tmp_path / "ref.png"), embeds, threshold
        )
        got, computed = _ditrun_cached_latents(
            tmp_path / "transformer", tmp_path / "vae", tmp_path / "ref.png", tmp_path / "embeds.safetensors", threshold
        )
        assert computed == diffusers_computed, threshold
        assert relative_error(got, expected) <= 1e-4, threshold
        cached.append(CACHE_STEPS - len(computed))
    assert cached[0] == 0 and cached[-1] > cached[1] > 0, cached  # the comparison covered cached steps
