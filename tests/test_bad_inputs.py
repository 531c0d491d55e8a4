"""Every bad input a user can give: one sentence naming the key, file or edit, exit status 2, and
nothing built. The cases run through ``ditrun``'s real entry point, in one subprocess for the
whole table (tests/cli_batch.py), so the table costs one interpreter start-up."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from ditrun.editor import FOLDER as EDITOR_FOLDER
from ditrun.model.load import random_model, save_pretrained
from ditrun.model.presets import PRESETS
from ditrun.workload.edit import Edit
from ditrun.workload.images import load_image

HERE = Path(__file__).parent
TINY = PRESETS["tiny"]  # joint_attention_dim 64, pooled_projection_dim 32
QUICK = [
    "model=tiny",
    "workload.width=32",
    "workload.height=32",
    "workload.steps=1",
    "workload.limit=1",
    "metrics.ssim=false",
    "wandb.mode=disabled",
    "metrics.report=false",
]


def _manifest(folder: Path, name: str, **edit) -> str:
    path = folder / f"{name}.jsonl"
    path.write_text(json.dumps({"id": name, "image": "skimage:coffee", **edit}) + "\n")
    return f"workload.manifest={path}"


def _embeddings(folder: Path, name: str, **tensors) -> str:
    path = folder / f"{name}.safetensors"
    save_file({k: torch.zeros(shape) for k, shape in tensors.items()}, str(path))
    return str(path)


def _model_folder(folder: Path, index_text=None, config_change=None) -> str:
    """A sharded tiny checkpoint, with its index or config.json rewritten."""
    save_pretrained(random_model(TINY), folder, max_shard_bytes=200_000)
    if index_text is not None:
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(index_text)
    if config_change is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_change}))
    return f"model.path={folder}"


# Each table: tmp folder -> [(arguments, the sentence fragment that must follow ``ditrun: error:``)].


def _number_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """README's "numbers" row: each number blamed on its own key."""
    return [
        (["workload.limit=-1"], "workload.limit=-1 must be a positive number of edits, or unset for all of them."),
        (["workload.steps=0"], "workload.steps=0 must be at least 1."),
        (["workload.text_len=-1"], "workload.text_len=-1 must be a positive number of stand-in prompt tokens."),
        (["workload.seed=-1"], "workload.seed=-1 is not a noise seed; allowed: 0 to 2**64 - 1."),
        (["workload.guidance_scale=nan"], "workload.guidance_scale=nan must be a finite number."),
        (
            ["workload.width=40"],
            "edit 'astronaut' has width=40 (workload.width); it must be a positive multiple of 16.",
        ),
        (["model.num_attention_heads=0"], "model.num_attention_heads=0 must be a positive integer."),
        (["model.num_layers=-1"], "model.num_layers=-1 must be 0 or more blocks."),
        (["model.attention_head_dim=64"], "model.attention_head_dim=64 does not fit preset 'tiny'"),
        (
            ["launcher.collective_timeout_s=nan"],
            "launcher.collective_timeout_s=nan must be a positive number of seconds.",
        ),
        (["metrics.ssim=true", "metrics.min_ssim_pct=nan"], "metrics.min_ssim_pct=nan must be a percentage above 0."),
        (
            ["cache=first_block", "cache.blocks=4"],
            "cache.blocks=4 must be 1 to 3, fewer than the model's 4 blocks, so that a cached step skips some",
        ),
    ]


def _image_cases(files: Path) -> list[tuple[list[str], str]]:
    """README's "pictures" row (and the rows below it): pictures and their size, refused before any model is built."""
    (files / "text.png").write_text("not a picture")
    Image.new("CMYK", (16, 16)).save(files / "cmyk.tiff")
    frames = [Image.new("RGB", (16, 16), c) for c in ("red", "blue")]
    frames[0].save(files / "two.gif", save_all=True, append_images=frames[1:])
    return [
        ([_manifest(files, "text", image=str(files / "text.png"))], "edit 'text': image file"),
        ([_manifest(files, "cmyk", image=str(files / "cmyk.tiff"))], "has PIL mode 'CMYK'; allowed:"),
        ([_manifest(files, "gif", image=str(files / "two.gif"))], "holds 2 frames; give one picture."),
        (
            [_manifest(files, "faces", image="skimage:lfw_subset")],
            "edit 'faces': image 'skimage:lfw_subset' is an array of shape (200, 25, 25), not a grey",
        ),
        (
            ["workload.width=131072", "workload.height=131072"],
            "edit 'astronaut' (131072x131072, 134217760 tokens) needs about",
        ),
    ]


def _workload_file_cases(files: Path) -> list[tuple[list[str], str]]:
    """README's "manifests" row and the "pictures" row's targets: a manifest is a regular file of bounded size
    whose ids are unique over all of it (``workload.limit=1`` here); a target file is a picture, checked with the
    other inputs."""
    os.mkfifo(files / "edits.fifo")
    with open(files / "huge.jsonl", "wb") as huge:
        huge.truncate(65 * 2**20)  # sparse: no disk written
    entries = [
        {"id": name, "image": "skimage:coffee", "prompt": prompt}
        for name, prompt in (("a", "first"), ("b", "second"), ("a", "third"))
    ]
    (files / "twice.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    (files / "words.txt").write_text("not a picture")
    (files / "octal.yaml").write_text("- id: 010\n  image: skimage:coffee\n  prompt: unquoted\n")
    Image.new("CMYK", (16, 16)).save(files / "cmyk_target.tiff")
    not_regular = "is not a regular file (a device, pipe or socket); give a YAML or JSONL file."
    return [
        (["workload.manifest=/dev/zero"], f"workload.manifest='/dev/zero' {not_regular}"),
        ([f"workload.manifest={files / 'edits.fifo'}"], f"edits.fifo' {not_regular}"),
        ([f"workload.manifest={files}"], "is a directory; give a YAML or JSONL file."),
        ([f"workload.manifest={files / 'huge.jsonl'}"], "huge.jsonl' is 65 MiB; a manifest is at most 64 MiB."),
        (
            [f"workload.manifest={files / 'twice.jsonl'}"],
            "edit id 'a' appears twice in the workload (entries 0 and 2, counting from 0); ids name output files.",
        ),
        (
            [f"workload.manifest={files / 'octal.yaml'}"],
            "workload edit #0 has id 8, a int, not a string (YAML reads an unquoted 010 as the number 8, and on, "
            'yes, no as booleans); quote the id in the manifest, e.g. id: "010".',
        ),
        ([_manifest(files, "folder", target=str(files))], f"edit 'folder': target file '{files}' is a directory;"),
        (
            [_manifest(files, "words", target=str(files / "words.txt"))],
            f"edit 'words': target file '{files / 'words.txt'}' is not a picture PIL can read",
        ),
        (
            [_manifest(files, "cmyk", target=str(files / "cmyk_target.tiff"))],
            f"edit 'cmyk': target file '{files / 'cmyk_target.tiff'}' has PIL mode 'CMYK'; allowed:",
        ),
    ]


def _embedding_cases(files: Path) -> list[tuple[list[str], str]]:
    (files / "pickle.safetensors").write_bytes(b"\x80\x04\x95 not safetensors at all")
    good = {"prompt_embeds": (7, 64), "pooled_prompt_embeds": (32,)}
    return [
        (
            [
                _manifest(
                    files,
                    "pooled",
                    prompt_embeds=_embeddings(files, "pooled", prompt_embeds=(7, 64), pooled_prompt_embeds=(31,)),
                )
            ],
            "pooled_prompt_embeds in",
        ),
        (
            [
                _manifest(
                    files,
                    "negative",
                    prompt_embeds=_embeddings(files, "negative", **good, negative_prompt_embeds=(7, 63)),
                )
            ],
            "has shape [7, 63]; allowed: [L, 64] or [1, L, 64] (joint_attention_dim=64).",
        ),
        (
            [
                _manifest(
                    files,
                    "batch",
                    prompt_embeds=_embeddings(files, "batch", prompt_embeds=(2, 7, 64), pooled_prompt_embeds=(32,)),
                )
            ],
            "prompt_embeds in",
        ),
        ([_manifest(files, "pickled", prompt_embeds=str(files / "pickle.safetensors"))], "is not a safetensors file"),
    ]


def _pipeline_folder(folder: Path, truncated: str) -> str:
    """The editor's pipeline folder copied (its DiT linked), with the safetensors of part ``truncated`` cut in half."""
    shutil.copytree(EDITOR_FOLDER, folder, ignore=shutil.ignore_patterns("transformer"))
    (folder / "transformer").symlink_to(EDITOR_FOLDER / "transformer")
    weights = next((folder / truncated).glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return f"model.path={folder}"


def _checkpoint_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """README's "checkpoints" row: every component of a model folder, the DiT's and the others'."""
    return [
        ([_pipeline_folder(tmp / "vae", "vae")], "/vae/diffusion_pytorch_model.safetensors is unreadable (truncated"),
        (
            [_pipeline_folder(tmp / "t5", "text_encoder_2")],
            "/text_encoder_2/model.safetensors is unreadable (truncated",
        ),
        ([_pipeline_folder(tmp / "clip", "text_encoder")], "/text_encoder/model.safetensors is unreadable (truncated"),
        (
            [f"workload.vae_path={tmp / 'no_vae'}"],
            f"workload.vae_path '{tmp / 'no_vae'}' is not a folder with config.json and *.safetensors.",
        ),
        ([_model_folder(tmp / "bad_index", index_text="{not json")], "safetensors.index.json is not valid JSON"),
        (
            [_model_folder(tmp / "escaping_index", index_text=json.dumps({"weight_map": {"x": "../x.safetensors"}}))],
            "maps 'x' to '../x.safetensors'; allowed: a *.safetensors file name in",
        ),
        (
            [_model_folder(tmp / "no_heads", config_change={"num_attention_heads": 0})],
            "config.json: num_attention_heads=0 must be a positive integer.",
        ),
    ]


def _hydra_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """Hydra's own mistakes, with the choices Hydra knows."""
    return [
        (
            ["workload.stpes=2"],
            "workload.stpes is not a key of workload (did you mean workload.steps?); allowed: name,",
        ),
        (["workload.steps=abc"], "workload.steps='abc' is not an integer"),
        (
            ["model=huge"],
            "model=huge is not a choice of config group 'model'; allowed: editor, flux-dev, krea3-tiny, small, tiny.",
        ),
        (["layout.name=???"], "layout.name has no value (???)"),
        (["+colour=1"], "colour is not a ditrun setting"),
        (["workload.steps"], "the override 'workload.steps' cannot be parsed (missing EQUAL at '<EOF>')"),
    ]


def _warm_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """``ditrun warm``'s (``warm.enabled=true``, as ``ditrun warm`` passes it) that cannot work; the run's sentence when
    it is given what only a warm reads."""
    warming = ["warm.enabled=true", "model.compile=on", f"model.compile_cache={tmp / 'cc'}"]
    return [
        ([*warming, "warm.sizes=[[40,48]]"], "warm.sizes[0]=[40, 48] has a size that is not a positive multiple of 16"),
        (["warm.enabled=true"], "model.compile=auto compiles nothing on cpu, so ditrun warm has nothing to warm"),
        ([*warming, "model.compile_cache=off"], "model.compile_cache=off keeps no entries"),
        (["warm.preset=kontext"], "warm.preset is read by ditrun warm only, and this run would ignore it"),
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "table",
    [_number_cases, _image_cases, _workload_file_cases, _embedding_cases, _checkpoint_cases, _hydra_cases, _warm_cases],
    ids=lambda t: t.__name__[1:-6],
)
def test_every_bad_input_is_one_sentence_before_any_work(tmp_path, table):
    cases = table(tmp_path)
    table = [[*QUICK, *args, f"hydra.run.dir={tmp_path / 'runs' / str(i)}"] for i, (args, _) in enumerate(cases)]
    (tmp_path / "cases.json").write_text(json.dumps(table))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DITRUN_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "cli_batch.py"), str(tmp_path / "cases.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases)
    wrong = [
        (args, result["exit"], result["stderr"][-600:])
        for (args, sentence), result in zip(cases, results)
        if not _one_sentence_before_work(result, sentence)
    ]
    assert not wrong, wrong
    # Refused before the directory is claimed: no record, no run.json, no Hydra files.
    assert not [path for name in ("edits.jsonl", "run.json", ".hydra") for path in (tmp_path / "runs").rglob(name)]


def _one_sentence_before_work(result: dict, sentence: str) -> bool:
    errors = [line for line in result["stderr"].splitlines() if line.startswith("ditrun: error: ")]
    return (
        result["exit"] == 2
        and len(errors) == 1
        and sentence in errors[0]
        and "Traceback" not in result["stderr"]
        and " edits on " not in result["stdout"]
    )  # the worker never started: no model was built


def test_grey_alpha_and_boolean_pictures_become_rgb(tmp_path):
    grey = (np.arange(32 * 48) % 251).astype(np.uint8).reshape(32, 48)
    Image.fromarray(np.stack([grey, np.full_like(grey, 128)], axis=-1), mode="LA").save(tmp_path / "la.png")
    Image.fromarray(grey, mode="L").save(tmp_path / "l.png")
    edits = {
        name: Edit(index=0, id=name, image=image, prompt="", seed=0, width=48, height=32, ref_width=48, ref_height=32)
        for name, image in (
            ("la", str(tmp_path / "la.png")),
            ("l", str(tmp_path / "l.png")),
            ("horse", "skimage:horse"),
        )
    }
    la, lum, horse = (load_image(edits[name]) for name in ("la", "l", "horse"))
    assert la.shape == (1, 3, 32, 48) and torch.equal(la, lum)  # alpha dropped, grey into R, G and B
    assert torch.equal(la[:, 0], la[:, 2])
    assert horse.shape == (1, 3, 32, 48) and horse.min() == 0 and horse.max() == 1  # True -> 1, False -> 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grey_alpha_png_and_boolean_image_run_end_to_end(tmp_path):
    grey = (np.arange(64 * 64) % 251).astype(np.uint8).reshape(64, 64)
    Image.fromarray(np.stack([grey, grey], axis=-1), mode="LA").save(tmp_path / "la.png")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(
            json.dumps(e) + "\n"
            for e in ({"id": "la", "image": str(tmp_path / "la.png")}, {"id": "horse", "image": "skimage:horse"})
        )
    )
    args = [a for a in QUICK if not a.startswith("workload.limit")]
    proc = subprocess.run(
        [sys.executable, "-m", "ditrun", *args, f"workload.manifest={manifest}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=220,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "edits.jsonl").read_text().splitlines()]
    assert [r["edit"] for r in records] == ["la", "horse"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hydra_flags_sweeps_and_debug_keep_working(tmp_path):
    sweep = ["-m", *QUICK, "workload.steps=1,abc", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    table = [["--help"], ["--cfg", "job", "workload.steps=3"], sweep]
    (tmp_path / "cases.json").write_text(json.dumps(table))
    proc = subprocess.run(
        [sys.executable, str(HERE / "cli_batch.py"), str(tmp_path / "cases.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    helped, shown, swept = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert helped["exit"] == 0 and "\nConfig groups (group=option" in helped["stdout"]
    assert shown["exit"] == 0 and "steps: 3" in shown["stdout"]
    assert swept["exit"] == 2 and "ditrun: error: workload.steps='abc' is not an integer" in swept["stderr"]
    for debug in ({"DITRUN_DEBUG": "1"}, {"HYDRA_FULL_ERROR": "1"}):  # the traceback behind the sentence
        proc = subprocess.run(
            [sys.executable, "-m", "ditrun", "model=huge"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **debug},
        )
        assert proc.returncode == 1 and "Traceback" in proc.stderr and "MissingConfigException" in proc.stderr
