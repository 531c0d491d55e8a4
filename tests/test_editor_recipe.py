"""The editor's training recipe (``python -m recipes.editor.train``) at tiny sizes on the CPU: every wrong argument is
one sentence before any work; a failed or interrupted training leaves an existing ``--out`` byte for byte as it
was; a training stopped by its budget and resumed gives the losses and the folder of one straight training; the
compiled step trains; the folder it writes loads in diffusers."""

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from ditrun.editor import transforms  # noqa: E402
from ditrun.model.dit import FluxDiT  # noqa: E402
from ditrun.model.presets import PRESETS  # noqa: E402
from recipes.editor.config import TrainConfig  # noqa: E402
from recipes.editor.data import Crops, DeadLeaves  # noqa: E402
from recipes.editor.dit import dit_loss, positions  # noqa: E402
from recipes.editor.phases import compiled  # noqa: E402
from recipes.editor.train import EXIT_STOPPED, EXIT_USAGE, main  # noqa: E402
from recipes.editor.vae import make_vae, vae_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Two small training pictures, one held-out picture, a VAE of a few channels, 32x32 edits, no CFG in the judgement.
TINY = [
    "--device",
    "cpu",
    "--seed",
    "3",
    "--size",
    "32",
    "--vae-crop",
    "32",
    "--vae-batch",
    "2",
    "--vae-widths",
    "8,8,16,16",
    "--vae-norm-groups",
    "8",
    "--vae-lr",
    "0.003",
    "--dit-batch",
    "2",
    "--dit-lr",
    "0.003",
    "--warmup",
    "2",
    "--pool",
    "4",
    "--eval-steps",
    "1",
    "--eval-cfg-scales",
    "1",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--train-pictures",
    "skimage:brick,sklearn:china.jpg",
    "--eval-pictures",
    "skimage:astronaut",
    "--compile",
    "off",
    "--no-wandb",
]


def _tree(folder: Path) -> dict:
    """Every file under ``folder`` by relative path -> sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _existing_folder(parent: Path) -> Path:
    """A folder that stands for a user's trained editor (any bytes will do: they must stay as they are)."""
    out = parent / "editor"
    (out / "text_encoder").mkdir(parents=True)
    (out / "text_encoder" / "model.safetensors").write_bytes(os.urandom(4096))
    (out / "model_index.json").write_text('{"_class_name": "FluxKontextPipeline"}\n')
    return out


def _losses(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "losses.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "bad, sentence",
    [
        (["--size", "100"], "--size 100: must be a positive multiple of 16"),
        (["--vae-batch", "0"], "--vae-batch 0: must be at least 1"),
        (["--vae-steps", "-5"], "--vae-steps -5: must not be negative"),
        (["--train-pictures", "skimage:brick,skimage:nope"], "skimage:nope is not a picture shipped"),
        (["--vae-widths", "40,80,160,160"], "--vae-norm-groups 16: must divide every width"),
        (["--vae-loss", "l2"], "--vae-loss l2: allowed: l1+mse, l1+ssim, l1+gradient"),
        (["--dead-leaves", "1.5"], "--dead-leaves 1.5: must be between 0 and 1"),
        (["--dit-stop-after", "20", "--dit-steps", "10"], "--dit-stop-after 20: must be at most --dit-steps 10"),
        (["--max-minutes", "5"], "--max-minutes and --max-steps need --checkpoint-dir"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--resume=required", "--checkpoint-dir", "no-such-checkpoints"], "no-such-checkpoints holds no checkpoint"),
        (["--compile", "fast"], "--compile fast: allowed: auto, off, inductor"),
        (["--vae-edited", "-0.1"], "--vae-edited -0.1: must be between 0 and 1"),
        (["--grey-untinted", "1.5"], "--grey-untinted 1.5: must be between 0 and 1"),
        (["--init", "nowhere"], "--init nowhere: not a pipeline folder this recipe wrote"),
        (["--edit-weights", "posterise=4"], "--edit-weights posterise=4: 'posterise=4' is not edit=weight"),
        (["--edit-weights", "blur=-1"], "--edit-weights blur=-1: 'blur=-1': a weight must not be negative"),
    ],
    ids=lambda value: value[0] if isinstance(value, list) else None,
)
def test_a_wrong_argument_is_one_sentence_before_any_work(tmp_path, capsys, bad, sentence):
    out = tmp_path / "editor"
    assert main(["--out", str(out), "--device", "cpu", *bad]) == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and sentence in lines[0] and lines[0].endswith("."), lines
    assert list(tmp_path.iterdir()) == []  # no folder, no records, no staging


def test_an_existing_folder_is_refused_unless_replace_is_given(tmp_path, capsys):
    out = _existing_folder(tmp_path)
    before = _tree(out)
    assert main(["--out", str(out), *TINY]) == EXIT_USAGE
    assert "is not empty; pass --replace" in capsys.readouterr().err
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["editor"]


@pytest.mark.slow
def test_a_checkpoint_is_resumed_only_with_its_own_settings(tmp_path, capsys):
    """A phase's checkpoint must agree with the resuming command on what trains that phase: another VAE learning
    rate is one sentence; another DiT length is not the VAE's business (a VAE-only command hands its VAE on)."""
    checkpoints = tmp_path / "checkpoints"
    args = [
        "--out",
        str(tmp_path / "editor"),
        *TINY,
        "--checkpoint-dir",
        str(checkpoints),
        "--vae-steps",
        "2",
        "--dit-steps",
        "0",
        "--max-steps",
        "1",
    ]
    assert main([*args, "--resume=required"]) == EXIT_USAGE  # nothing to continue from yet
    assert "holds no checkpoint of a phase" in capsys.readouterr().err
    assert main(args) == EXIT_STOPPED
    capsys.readouterr()
    assert main([*args, "--resume", "--vae-lr", "0.002"]) == EXIT_USAGE
    assert "was made with --vae-lr 0.003, not 0.002; resume with the same settings" in capsys.readouterr().err
    assert main(args) == EXIT_USAGE  # a training is there: --resume or another folder
    assert "holds a training; pass --resume" in capsys.readouterr().err
    # the VAE's last step, then the DiT's budget
    assert main([*args, "--resume=required", "--dit-steps", "2"]) == EXIT_STOPPED
    assert torch.load(checkpoints / "vae.pt", weights_only=True)["done"]
    assert torch.load(checkpoints / "dit.pt", weights_only=True)["step"] == 0


@pytest.mark.slow
def test_the_gpu_script_continues_only_where_its_checkpoint_is(tmp_path):
    """benchmarks/train_editor.sh with CONTINUE=1 on a machine without the checkpoint (a fresh machine): one
    sentence and exit status 2 before any work, no folder, rather than a training from the start."""
    tree = tmp_path / "repo"
    (tree / "benchmarks").mkdir(parents=True)
    for script in ("train_editor.sh", "wheels.sh"):
        (tree / "benchmarks" / script).write_bytes((REPO / "benchmarks" / script).read_bytes())
    (tree / "recipes").symlink_to(REPO / "recipes")  # the recipe, without the repository's carried wheels
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "CONTINUE": "1",
        "OUT": str(tmp_path / "out"),
        "CHECKPOINTS": str(tmp_path / "checkpoints"),
        "FOLDER": str(tmp_path / "editor"),
    }
    proc = subprocess.run(
        ["bash", str(tree / "benchmarks" / "train_editor.sh"), *TINY],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    log = (tmp_path / "out" / "train.log").read_text().strip().splitlines()
    assert len(log) == 1 and "--resume=required" in log[0] and "holds no checkpoint of a phase" in log[0], log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "repo"]


@pytest.mark.slow
def test_a_failed_training_leaves_the_folder_unchanged(tmp_path):
    """A VAE folder whose weights are not safetensors fails the training after the text encoders were written
    (into the folder being built, not into --out): the folder given with --replace is byte for byte unchanged."""
    out = _existing_folder(tmp_path)
    before = _tree(out)
    broken = tmp_path / "broken_vae"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", "latent_channels": 16}))
    (broken / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(OSError, match="Unable to load weights"):
        main(["--out", str(out), "--replace", *TINY, "--vae-from", str(broken), "--dit-steps", "2"])
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken_vae", "editor", "editor.training"]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_training_leaves_the_folder_unchanged(tmp_path, stop):
    """Ctrl-C (SIGINT) or a scheduler's SIGTERM while the new folder is being built: --out keeps its bytes and
    nothing is left beside it."""
    out = _existing_folder(tmp_path)
    before = _tree(out)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recipes.editor.train",
            "--out",
            str(out),
            "--replace",
            *TINY,
            "--vae-steps",
            "1000",
            "--dit-steps",
            "2",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as at a terminal: a shell that starts the tests in the background leaves SIGINT ignored, for its children too
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".editor.*.partial/text_encoder_2/*.safetensors")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(1)  # into the VAE's training
    proc.send_signal(stop)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == (-stop if stop == signal.SIGINT else 128 + stop), stderr[-2000:]
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["editor", "editor.training"]


@pytest.mark.slow
def test_a_resumed_training_continues_the_same_loss_curve(tmp_path, capsys):
    """2 VAE steps and 2 DiT steps straight, against the same training stopped by --max-steps after 1 step (in the
    VAE), resumed for 2 more (the VAE's last, the DiT's first), then resumed to the end (its pool of encoded crops
    read from the checkpoint folder, not encoded again): the same losses at every step and the same folder."""
    steps = ["--vae-steps", "2", "--dit-steps", "2", "--pool", "2"]
    assert main(["--out", str(tmp_path / "straight"), *TINY, *steps]) == 0
    split = ["--out", str(tmp_path / "split"), *TINY, *steps, "--checkpoint-dir", str(tmp_path / "checkpoints")]
    assert main([*split, "--max-steps", "1"]) == EXIT_STOPPED
    assert main([*split, "--resume", "--max-steps", "2"]) == EXIT_STOPPED
    assert "train: pool of 2 crops encoded in" in capsys.readouterr().out
    assert main([*split, "--resume"]) == 0
    assert f"train: pool of 2 crops read from {tmp_path / 'checkpoints' / 'pool.pt'}" in capsys.readouterr().out
    straight, resumed = _losses(tmp_path / "straight.training"), _losses(tmp_path / "split.training")
    assert [(r["phase"], r["step"]) for r in straight] == [("vae", 0), ("vae", 1), ("dit", 0), ("dit", 1)]
    assert [(r["phase"], r["step"]) for r in resumed] == [(r["phase"], r["step"]) for r in straight]
    for a, b in zip(straight, resumed):
        for key in (k for k in a if "/" in k):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a, b)
    assert _tree(tmp_path / "split") == _tree(tmp_path / "straight")


def test_a_kept_pool_is_read_only_under_the_same_fingerprint(tmp_path):
    """``Checkpoints.cached``: what was made under a key is read back under that key, made again under another (a
    changed VAE, say), and kept nowhere without a folder; the fingerprint sees a tensor's every byte."""
    from recipes.editor.checkpoint import Checkpoints, fingerprint

    made = []

    def make():
        made.append(1)
        return {"refs": torch.full((2,), float(len(made)))}

    store = Checkpoints(tmp_path / "checkpoints", TrainConfig())
    weights = torch.zeros(3)
    key = fingerprint(torch.tensor([1, 2]), ("a",), 4, {"w": weights})
    for read in (False, True):
        value, was_read = store.cached("pool", key, make)
        assert was_read is read and torch.equal(value["refs"], torch.full((2,), 1.0)) and len(made) == 1
    weights[1] = 1e-30
    other = fingerprint(torch.tensor([1, 2]), ("a",), 4, {"w": weights})
    assert other != key and store.cached("pool", other, make)[1] is False and len(made) == 2
    assert Checkpoints(None, TrainConfig()).cached("pool", key, make)[1] is False and len(made) == 3


def _tensors(file: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(file)


@pytest.mark.slow
def test_a_training_goes_on_from_a_folder_keeping_its_latents_and_text_encoders(tmp_path, capsys):
    """--init A: zero more steps give A again, byte for byte; two more of each phase train A's decoder (its encoder
    and latent statistics, so its latents, unchanged) and its DiT, and keep its text parts. A VAE shape other than
    A's is one sentence."""
    first = tmp_path / "first"
    assert main(["--out", str(first), *TINY, "--vae-steps", "2", "--dit-steps", "2", "--pool", "2"]) == 0
    go_on = [*TINY, "--init", str(first), "--pool", "2"]
    assert main(["--out", str(tmp_path / "same"), *go_on, "--vae-steps", "0", "--dit-steps", "0"]) == 0
    assert _tree(tmp_path / "same") == _tree(first)
    assert main(["--out", str(tmp_path / "more"), *go_on, "--vae-steps", "2", "--dit-steps", "2"]) == 0
    before, after = _tree(first), _tree(tmp_path / "more")
    assert {k: v for k, v in after.items() if not k.startswith(("vae/", "transformer/"))} == {
        k: v for k, v in before.items() if not k.startswith(("vae/", "transformer/"))
    }
    weights = "vae/diffusion_pytorch_model.safetensors"
    old, new = _tensors(first / weights), _tensors(tmp_path / "more" / weights)
    assert all(torch.equal(old[k], new[k]) for k in old if k.startswith("encoder."))
    assert any(not torch.equal(old[k], new[k]) for k in old if k.startswith("decoder."))
    configs = [json.loads((f / "vae" / "config.json").read_text()) for f in (first, tmp_path / "more")]
    assert [(c["shift_factor"], c["scaling_factor"]) for c in configs] == [
        (configs[0]["shift_factor"], configs[0]["scaling_factor"])
    ] * 2
    dit = "transformer/diffusion_pytorch_model.safetensors"
    assert after[dit] != before[dit]
    capsys.readouterr()
    assert main(["--out", str(tmp_path / "other"), *go_on, "--vae-widths", "16,16,16,16"]) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == (
        "train: --vae-widths 16,16,16,16: must be 8,8,16,16, the --init folder's."
    )


@pytest.mark.slow
def test_a_folders_dit_goes_on_over_a_decoder_trained_from_its_vae(tmp_path, capsys):
    """--init A --vae-from B/vae, where B's decoder alone was trained from A: the new folder holds B's VAE byte for
    byte and A's DiT trained further. A VAE of another encoder, or VAE steps asked for as well, is one sentence."""
    first, decoder = tmp_path / "first", tmp_path / "decoder"
    assert main(["--out", str(first), *TINY, "--vae-steps", "2", "--dit-steps", "2", "--pool", "2"]) == 0
    go_on = [*TINY, "--init", str(first), "--pool", "2"]
    assert main(["--out", str(decoder), *go_on, "--vae-steps", "2", "--dit-steps", "0"]) == 0
    carried = tmp_path / "carried"
    carry = ["--vae-from", str(decoder / "vae"), "--vae-steps", "0"]
    assert main(["--out", str(carried), *go_on, *carry, "--dit-steps", "2"]) == 0
    after = _tree(carried)
    assert {k: v for k, v in after.items() if k.startswith("vae/")} == {
        k: v for k, v in _tree(decoder).items() if k.startswith("vae/")
    }
    dit = "transformer/diffusion_pytorch_model.safetensors"
    assert after[dit] != _tree(first)[dit]

    from safetensors.torch import save_file

    other = tmp_path / "other_vae"
    other.mkdir()
    (other / "config.json").write_text((decoder / "vae" / "config.json").read_text())
    weights = _tensors(decoder / "vae" / "diffusion_pytorch_model.safetensors")
    name = next(k for k in weights if k.startswith("encoder."))
    weights[name] = weights[name] + 1
    save_file(weights, str(other / "diffusion_pytorch_model.safetensors"))
    capsys.readouterr()
    assert (
        main(["--out", str(tmp_path / "refused"), *go_on, "--vae-from", str(other), "--vae-steps", "0"]) == EXIT_USAGE
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "its encoder or latent statistics differ from the --init folder's VAE" in lines[0]
    assert main(["--out", str(tmp_path / "refused"), *go_on, *carry[:2], "--vae-steps", "3"]) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == (
        "train: --vae-from with --init trains only the DiT, on that VAE: --vae-steps 3 must be 0."
    )
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_the_command_writes_a_folder_diffusers_loads_and_its_records(tmp_path):
    """The command as a user runs it, half of each VAE batch dead leaves: the folder loads in diffusers; the losses
    and the measurements during training went to losses.jsonl and an offline W&B run; eval.json holds the
    per-instruction summary; train.json the settings."""
    import diffusers

    args = [a for a in TINY if a != "--no-wandb"] + [
        "--eval-every",
        "2",
        "--vae-steps",
        "2",
        "--dit-steps",
        "2",
        "--pool",
        "2",
        "--dead-leaves",
        "0.5",
    ]  # the last value counts
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.editor.train", "--out", str(tmp_path / "editor"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| all |" in proc.stdout and "vae round trip: median PSNR" in proc.stdout
    records = tmp_path / "editor.training"
    assert list((records / "wandb").glob("offline-run-*"))
    rows = _losses(records)
    assert [(r["phase"], r["step"]) for r in rows] == [
        ("vae", 0),
        ("vae", 1),
        ("vae", 1),
        ("dit", 0),
        ("dit", 1),
        ("dit", 1),
    ]
    assert "vae/eval_psnr" in rows[2] and "dit/eval_margin" in rows[5]
    summary = json.loads((records / "eval.json").read_text())["summary"]
    # The last step's measure per instruction is the judgement's at the last CFG scale (the same EMA, edits, seeds).
    per_instruction = {k.split("/")[-1]: v for k, v in rows[5].items() if k.startswith("dit/eval_margin/")}
    judged = summary[[k for k in summary if k != "vae_ceiling"][-1]]
    assert per_instruction == pytest.approx(
        {name: row["margin_median"] for name, row in judged.items() if name != "all" and row["counted"]}
    )
    assert len(per_instruction) >= 8 and rows[5]["dit/eval_margin_lowest"] == min(per_instruction.values())
    assert summary["true_cfg_scale=1"]["all"]["counted"] == 9 and summary["vae_ceiling"]["all"]["counted"] == 9
    assert json.loads((records / "train.json").read_text())["config"]["vae_widths"] == [8, 8, 16, 16]
    assert diffusers.FluxKontextPipeline.from_pretrained(tmp_path / "editor").transformer.config.num_layers == 4


def _vae_case():
    cfg = TrainConfig(vae_widths=(8, 8, 16, 16), vae_norm_groups=8, vae_loss="l1+ssim")
    torch.manual_seed(0)
    model = make_vae(cfg).train()
    x, eps = torch.rand(2, 3, 32, 32) * 2 - 1, torch.randn(2, 16, 4, 4)
    return model, lambda fn: fn(model, x, eps, cfg)["loss"]


def _dit_case():
    """The editor's DiT with one block of each kind: the trace of its 4 + 8 is the same two blocks' code unrolled."""
    torch.manual_seed(0)
    model = FluxDiT(replace(PRESETS["editor"], num_layers=1, num_single_layers=1)).train()
    with torch.no_grad():  # adaLN-zero starts with zero gradients for most weights: move off zero first
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ids, txt_ids = positions(32, 8, torch.device("cpu"))
    xt, ref, target = torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    embeds, pooled, sigma = torch.randn(2, 8, 64), torch.randn(2, 64), torch.rand(2)
    return model, lambda fn: fn(model, xt, ref, embeds, pooled, sigma, target, ids, txt_ids)


@pytest.mark.slow
@pytest.mark.parametrize("case", [_vae_case, _dit_case], ids=["vae", "dit"])
def test_the_compiled_step_computes_what_the_eager_step_does(case):
    """Each phase's loss through ``--compile aot_eager``, which traces it as inductor would (dynamo, AOT autograd;
    inductor's code generation takes minutes on these CPUs), equals the eager loss, and so do the gradients. The
    random draws are inputs, so the traced step has no generator in it."""
    model, loss_of = case()
    fn = vae_loss if case is _vae_case else dit_loss
    results = []
    for step in (fn, compiled(fn, "aot_eager", torch.device("cpu"))):
        model.zero_grad(set_to_none=True)
        loss = loss_of(step)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (eager, eager_grads), (traced, traced_grads) = results
    assert torch.allclose(traced, eager, rtol=1e-5, atol=1e-7)
    assert len(traced_grads) == len(eager_grads) > 0
    assert all(torch.allclose(t, e, rtol=1e-4, atol=1e-6) for t, e in zip(traced_grads, eager_grads))


class _Lossless:
    """A codec that keeps every picture exactly (its latents are the pixels)."""

    encode = decode = staticmethod(lambda x: x)


def test_the_ceiling_of_a_lossless_codec_is_every_correct_edit_exactly():
    """The VAE's ceiling judges each correct edit after the codec's round trip: through a codec that loses nothing,
    every edit is the correct result exactly and beats every naive candidate."""
    from ditrun.metrics.target import PSNR_CAP_DB
    from recipes.editor import evaluate

    names = ("skimage:astronaut", "skimage:camera")
    summary = evaluate.summarize(evaluate.ceiling(_Lossless(), evaluate.reference_pictures(32, "cpu", names), names))
    assert summary["all"]["psnr_median"] == PSNR_CAP_DB
    # every edit whose correct result differs from the input (not grayscale and blue of the grey camera, nor blur
    # at this size)
    assert summary["all"]["beat_all"] == summary["all"]["counted"] == 16


def test_fewer_poster_levels_move_the_correct_result_further_from_the_input():
    """posterize at 2, 3 and 4 levels: the input unchanged scores lower the fewer levels there are; through a codec
    that loses nothing, the correct result is exact at every level and beats every naive candidate."""
    from ditrun.metrics.target import PSNR_CAP_DB
    from recipes.editor import evaluate

    names = ("skimage:astronaut", "skimage:coffee")
    rows = evaluate.posterize_levels(_Lossless(), evaluate.reference_pictures(32, "cpu", names), names, (2, 3, 4))
    assert rows[2]["input_psnr_median"] < rows[3]["input_psnr_median"] < rows[4]["input_psnr_median"]
    assert all(row["ceiling_psnr_median"] == PSNR_CAP_DB and row["ceiling_margin_min"] > 0 for row in rows.values())


def test_dead_leaves_are_pictures_of_discs_drawn_from_the_seed():
    """Dead-leaves pictures: in [0, 1], of many colours and edges, the same again from the same generator state."""
    crops = Crops(["sklearn:china.jpg"], torch.device("cpu"), torch.Generator().manual_seed(0))
    leaves = DeadLeaves(crops, seed=1)
    state = crops.gen.get_state()
    pictures = leaves.batch(2, 48)
    assert pictures.shape == (2, 3, 48, 48) and 0 <= pictures.min() and pictures.max() <= 1
    assert len(torch.unique(pictures[0].reshape(3, -1), dim=1).T) > 50  # many colours, soft edges between them
    assert not torch.equal(pictures[0], pictures[1])
    crops.gen.set_state(state)
    assert torch.equal(leaves.batch(2, 48), pictures)


def test_edit_weights_set_how_often_each_edit_is_drawn():
    """--edit-weights posterize=4: posterize is drawn 4 times as often as each other edit (4 of 13 draws); without
    weights every edit equally often."""
    from types import SimpleNamespace

    from recipes.editor.config import edit_weights
    from recipes.editor.data import EMPTY_PROMPT, Batches

    names = transforms.EDITS.names()
    pool = SimpleNamespace(
        names=names,
        refs=torch.zeros(3, 1, 64),
        targets=torch.arange(len(names), dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 1, 64),
    )
    prompts = {EMPTY_PROMPT: 0, **{t: 1 for n in names for t in transforms.EDITS.get(n, "edit").phrasings}}
    for weights, share in ((edit_weights("posterize=4"), 4 / 13), ({}, 1 / 10)):
        batches = Batches(pool, prompts, 0.0, torch.Generator().manual_seed(0), weights)
        _, targets, _ = batches.draw(6000)
        drawn = torch.bincount(targets[:, 0, 0].long(), minlength=len(names)).float() / 6000
        assert abs(drawn[names.index("posterize")] - share) < 0.02, drawn
        others = [drawn[i] for i, n in enumerate(names) if n != "posterize"]
        assert max(abs(d - (1 - share) / 9) for d in others) < 0.02, drawn


def test_a_checkpoint_without_a_newer_option_was_made_with_its_default():
    """A checkpoint's settings lack an option added after it was made: it resumes under the option's default and
    names the difference under any other value."""
    from recipes.editor.config import VAE_FIELDS, changed

    saved = dataclasses.asdict(TrainConfig())
    del saved["grey_untinted"]
    assert changed(saved, TrainConfig(), VAE_FIELDS) is None
    assert changed(saved, TrainConfig(grey_untinted=0.5), VAE_FIELDS) == "--grey-untinted 0.0, not 0.5"


def test_grey_crops_are_left_grey_for_the_untinted_fraction():
    """--grey-untinted: 0 tints every crop of a grey picture (its channels differ), 1 leaves every one grey, 0.5
    about half; a colour picture's crops are the same whatever the fraction (no draw is added for them)."""

    def crops(names, untinted):
        return Crops(names, torch.device("cpu"), torch.Generator().manual_seed(0), untinted).batch(64, 16)

    def grey_share(untinted):
        return sum(
            bool(torch.equal(c[0], c[1]) and torch.equal(c[1], c[2])) for c in crops(["skimage:camera"], untinted)
        )

    assert grey_share(0.0) == 0 and grey_share(1.0) == 64 and 16 < grey_share(0.5) < 48
    assert torch.equal(crops(["sklearn:china.jpg"], 0.0), crops(["sklearn:china.jpg"], 1.0))


def test_edited_vae_pictures_are_known_edits_of_the_pictures_drawn():
    """--vae-edited 0.5: the batch's pictures are those drawn without it, half of them each replaced by one of the
    known edits of itself."""
    from ditrun.editor import transforms
    from recipes.editor.data import vae_batch

    crops = Crops(["sklearn:china.jpg", "skimage:camera"], torch.device("cpu"), torch.Generator().manual_seed(0))
    leaves = DeadLeaves(crops, seed=1)
    state = crops.gen.get_state()
    plain = vae_batch(crops, leaves, 8, 32, 0.5)
    crops.gen.set_state(state)
    edited = vae_batch(crops, leaves, 8, 32, 0.5, edited=0.5)
    kinds = []
    for before, after in zip(plain, edited):
        if torch.equal(before, after):
            continue
        kinds += [n for n in transforms.EDITS.names() if torch.equal(transforms.apply(n, before[None])[0], after)]
    assert len(kinds) == 4 and len(set(kinds)) > 1


def test_the_curves_of_a_dit_only_training_are_one_panel(tmp_path):
    """A log with steps of both phases draws two panels side by side; a DiT-only training's (``--vae-steps 0``), the
    DiT's alone, at the same size each."""
    import matplotlib.image

    from recipes.editor.plot import main as plot

    dit = [{"phase": "dit", "step": s, "dit/loss": 1.0 / (s + 1)} for s in range(5)]
    vae = [{"phase": "vae", "step": s, "vae/loss": 1.0 / (s + 1)} for s in range(5)]
    widths = {}
    for name, rows in (("both", vae + dit), ("dit", dit)):
        log = tmp_path / f"{name}.jsonl"
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert plot([str(log), str(tmp_path / f"{name}.png")]) == 0
        widths[name] = matplotlib.image.imread(tmp_path / f"{name}.png").shape[1]
    assert widths["both"] == 2 * widths["dit"]


@pytest.mark.slow
def test_a_folder_is_judged_as_the_training_judges_it(tmp_path):
    """``python -m recipes.editor.evaluate FOLDER --edits --json F``: every instruction on every held-out picture at
    true CFG 1 and 2.5, in eval.json's form, beside the VAE's round trip and ceiling that the plain command gives."""
    from ditrun.editor.transforms import EDITS
    from recipes.editor import evaluate
    from recipes.editor.pictures import HELD_OUT

    folder = tmp_path / "editor"
    assert main(["--out", str(folder), *TINY, "--vae-steps", "2", "--dit-steps", "2", "--pool", "2"]) == 0
    plain, judged = tmp_path / "plain.json", tmp_path / "judged.json"
    evaluate.main([str(folder), "--size", "32", "--json", str(plain)])
    evaluate.main([str(folder), "--size", "32", "--edits", "--json", str(judged)])
    plain, judged = json.loads(plain.read_text()), json.loads(judged.read_text())
    assert judged["vae_roundtrip"] == plain["vae_roundtrip"] and list(judged["vae_roundtrip"]) == list(HELD_OUT)
    assert judged["edits"]["vae_ceiling"] == plain["vae_ceiling"]
    for scale in ("true_cfg_scale=1", "true_cfg_scale=2.5"):
        assert set(judged["edits"][scale]) == set(EDITS.names())
        scored = [m for by_picture in judged["edits"][scale].values() for m in by_picture.values()]
        assert len(scored) == len(EDITS.names()) * len(HELD_OUT) and all(m["psnr"] > 0 for m in scored)
        counted = judged["summary"][scale]["all"]["counted"]  # edits whose correct result differs from the input
        assert counted == judged["summary"]["vae_ceiling"]["all"]["counted"] > 0


def test_evaluate_refuses_a_device_it_cannot_use(capsys):
    """One sentence before any picture is loaded."""
    from recipes.editor import evaluate

    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--edits", "--device", "tpu"])
    assert stop.value.code == 2 and "--device tpu: not a device torch knows" in capsys.readouterr().err
