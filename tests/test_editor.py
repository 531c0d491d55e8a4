"""ditrun's trained editor: the committed pipeline folder edits held-out pictures as its training measured,
diffusers' FluxKontextPipeline and ditrun give the same image from it, and a precision the editor cannot keep fails
the run's quality gate with one sentence. Its training recipe is tested in test_editor_recipe.py."""

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from skimage import io

diffusers = pytest.importorskip("diffusers")

from ditrun_cli import ditrun  # noqa: E402
from launching import relative_error  # noqa: E402

from ditrun.editor import FOLDER, transforms  # noqa: E402

EVAL = json.loads((Path(__file__).resolve().parents[1] / "docs" / "editor" / "eval.json").read_text())
QUIET = ["wandb.mode=disabled", "progress=false", "metrics.report=false"]


def _manifest(path: Path, edits: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(e) for e in edits) + "\n")
    return path


def _records(out: Path) -> dict:
    return {r["edit"]: r for r in map(json.loads, (out / "edits.jsonl").read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_folder_reproduces_its_held_out_results(tmp_path):
    """Three held-out edits through the ``ditrun`` command on the CPU (fp32): PSNR against the correct edit
    within 1 dB of what the training's evaluation measured on its GPU (bf16) for the same picture, instruction,
    seed, steps and CFG scale, and each edit beats every naive candidate as it did there."""
    cases = [("skimage:camera", "pixelate"), ("skimage:chelsea", "sepia"), ("skimage:rocket", "posterize")]
    manifest = _manifest(
        tmp_path / "m.jsonl",
        [
            {
                "id": edit,
                "image": picture,
                "prompt": transforms.EDITS.get(edit, "edit").phrasings[0],
                "target": edit,
                "seed": EVAL["pictures"].index(picture),
            }
            for picture, edit in cases
        ],
    )
    out = tmp_path / "run"
    proc = ditrun(
        "model=editor",
        "device=cpu",  # the CPU's fp32 where a GPU is visible too: what the docstring promises
        f"workload.manifest={manifest}",
        f"workload.steps={EVAL['steps']}",
        "metrics.ssim=false",
        *QUIET,
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr
    records = _records(out)
    for picture, edit in cases:
        measured = EVAL["edits"]["true_cfg_scale=2.5"][edit][picture]
        assert abs(records[edit]["psnr_target"] - measured["psnr"]) <= 1.0, (edit, records[edit], measured)
        assert measured["margin"] > 0 and records[edit]["margin_db"] > 0, (edit, records[edit], measured)


@functools.cache
def _pipeline():
    pipe = diffusers.FluxKontextPipeline.from_pretrained(FOLDER, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _diffusers_edit(image: Path, prompt: str, true_cfg_scale: float, width: int, height: int, steps: int, seed: int):
    pipe = _pipeline()
    negative = {"negative_prompt": ""} if true_cfg_scale > 1 else {}
    with torch.no_grad():
        common = dict(
            image=Image.open(image),
            prompt=prompt,
            height=height,
            width=width,
            max_area=width * height,
            num_inference_steps=steps,
            true_cfg_scale=true_cfg_scale,
            max_sequence_length=32,
            _auto_resize=False,
            **negative,
        )
        latents = pipe(**common, generator=torch.Generator().manual_seed(seed), output_type="latent").images
        picture = pipe(**common, generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
    return latents, np.round(picture * 255).astype(np.uint8)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ditrun_equals_diffusers_on_the_folder(tmp_path):
    """Prompt text in, image out: ``ditrun model=editor`` and ``FluxKontextPipeline.from_pretrained`` of the same
    folder, same seed, a 96x64 output from a 64x48 reference, with true CFG and without (the two runs of one
    ``ditrun -m`` sweep). diffusers runs true CFG only with a negative prompt: ditrun's is the empty prompt, so the
    diffusers user passes ``negative_prompt=""``."""
    width, height, steps, seed, prompt = 96, 64, 3, 7, "make it black and white"
    scales = (2.5, 1.0)
    rgb = (np.random.default_rng(1).random((48, 64, 3)) * 255).astype(np.uint8)
    Image.fromarray(rgb).save(tmp_path / "ref.png")
    edit = {"id": "e", "image": str(tmp_path / "ref.png"), "prompt": prompt, "seed": seed}
    sweep = tmp_path / "sweep"
    proc = ditrun(
        "-m",
        "model=editor",
        "device=cpu",  # diffusers runs on the CPU in fp32 below: the same device and dtype
        f"workload.manifest={_manifest(tmp_path / 'm.jsonl', [edit])}",
        f"workload.width={width}",
        f"workload.height={height}",
        f"workload.steps={steps}",
        "workload.ref_resize=none",
        f"workload.true_cfg_scale={','.join(map(str, scales))}",
        f"workload.prompt_cache_dir={tmp_path / 'prompts'}",
        "metrics.ssim=false",
        *QUIET,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr
    for job, true_cfg_scale in enumerate(scales):
        out = sweep / str(job)
        workload = json.loads((out / "summary.json").read_text())["config"]["workload"]  # the folder's 32 tokens
        assert workload["true_cfg_scale"] == true_cfg_scale
        assert (workload["text_len"], workload["text_len_from"]) == (
            32,
            f"{FOLDER / 'tokenizer_2'}/tokenizer_config.json (model_max_length)",
        )
        expected_latents, expected_image = _diffusers_edit(
            tmp_path / "ref.png", prompt, true_cfg_scale, width, height, steps, seed
        )
        record = _records(out)["e"]
        got = load_file(out / record["latents"])
        latents = next(iter(got.values()))
        assert relative_error(latents.reshape(expected_latents.shape), expected_latents) <= 1e-4, true_cfg_scale
        image = io.imread(out / record["image"])
        assert image.shape == expected_image.shape == (height, width, 3)
        assert np.abs(image.astype(int) - expected_image.astype(int)).max() <= 1, true_cfg_scale


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_precision_the_editor_cannot_keep_fails_the_gate(tmp_path):
    """On the trained weights MXFP4 moves the image: with ``metrics.min_ssim_pct`` above what it keeps, the run
    exits 1 with the sentence naming the key."""
    out = tmp_path / "run"
    proc = ditrun(
        "model=editor",
        "precision=mxfp4",
        "workload.limit=1",
        "workload.width=64",
        "workload.height=64",
        "workload.steps=4",
        "metrics.min_ssim_pct=99.9",
        "metrics.quality=rerun",
        *QUIET,
        f"hydra.run.dir={out}",
        cwd=tmp_path,
        timeout=280,
    )
    assert proc.returncode == 1, proc.stderr
    assert "metrics.min_ssim_pct=99.9" in proc.stderr and "quality gate failed" in proc.stderr
    record = next(iter(_records(out).values()))
    assert record["ssim_pct_of_rerun"] < 99.9 and record["ssim_target"] is not None


def test_a_target_is_a_known_edit_or_an_image_file(tmp_path):
    """``target`` names an edit of the registry (that transform of the reference at the output's size) or a picture
    file (resized to the output's size); anything else is one sentence naming the allowed values."""
    from omegaconf import OmegaConf

    from ditrun.config import WorkloadConfig
    from ditrun.workload.edit import WorkloadError
    from ditrun.workload.images import load_image, target_image
    from ditrun.workload.manifest import resolve_edits

    def edit(target):
        workload = OmegaConf.merge(
            OmegaConf.structured(WorkloadConfig),
            {"edits": [{"id": "e", "image": "skimage:coffee", "target": target}], "width": 64, "height": 32},
        )
        return resolve_edits(workload)[0]

    inverted = target_image(edit("invert"))
    reference = load_image(edit("invert"))[0].permute(1, 2, 0).numpy()
    assert inverted.shape == (32, 64, 3) and np.abs(inverted / 255 - (1 - reference)).max() <= 0.5 / 255 + 1e-6
    Image.fromarray(np.full((10, 20, 3), 200, np.uint8)).save(tmp_path / "t.png")
    assert (target_image(edit(str(tmp_path / "t.png"))) == 200).all()
    with pytest.raises(WorkloadError, match=r"target='rotate'; allowed: an edit name \(mirror, upside_down"):
        edit("rotate")
