"""Train ditrun's editor from a seed: the VAE on picture crops, then the DiT on edits, then judge it.

    python -m ditrun.editor.train --out editor/ [--seed 0] [--vae-steps N] [--dit-steps N] [--device cuda]

Writes a diffusers ``FluxKontextPipeline`` folder to ``--out`` (text encoders and tokenizers from
``folder.py``, the VAE and the DiT trained here, bf16/fp16 safetensors) and, beside it in
``--log-dir`` (default ``<out>.training``), ``losses.jsonl`` (one line per logged step),
``eval.json`` (SSIM against the correct edit per instruction on the held-out pictures), ``train.json``
(the settings, times and library versions) and, when W&B is installed, an offline W&B run.

The DiT is ditrun's own ``FluxDiT`` in the ``editor`` geometry, trained with rectified flow exactly as
ditrun samples (``x_t = (1 - sigma) x_0 + sigma * noise``, velocity ``noise - x_0``, sigma drawn
logit-normal and shifted by Flux's resolution shift), conditioned Kontext-style on the reference's
latent tokens (position ids with first axis 1) placed after the output's. A fraction of the prompts is
replaced by the empty prompt, which is the unconditional branch of true CFG. Everything random (data,
initial weights, noise) comes from ``--seed``; on a GPU the attention runs PyTorch's math backend and
deterministic algorithms are asked for, so a rerun on the same machine and library versions repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ditrun.editor import folder as parts
from ditrun.editor import pictures, transforms
from ditrun.model.dit import FluxDiT
from ditrun.model.latents import pack, token_ids, unpack
from ditrun.model.presets import PRESETS
from ditrun.model.sampler import EditInputs, denoise, sequential_cfg_velocity, time_shift_mu

EMPTY_PROMPT = ""
# Zero-initialised so that every block starts as the identity and the model's output as zero (adaLN-zero).
ZERO_INIT = ("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear", "proj_out")


@dataclasses.dataclass
class TrainConfig:
    """Every setting of one training run (recorded in train.json and the W&B run)."""

    seed: int = 0
    size: int = 256
    """Pixel size of the DiT's training edits (square); the VAE trains on crops of ``vae_crop``."""
    vae_steps: int = 3000
    vae_batch: int = 32
    vae_crop: int = 128
    vae_lr: float = 1e-3
    vae_kl: float = 1e-6
    dit_steps: int = 12000
    dit_batch: int = 256
    dit_lr: float = 1e-3
    warmup: int = 200
    pool: int = 8192
    """Reference crops encoded once, with every edit of each (the DiT's training set)."""
    dit_time_limit_s: float = 0.0
    """Stop the DiT's training after this many seconds (0: never), the learning-rate schedule still that of
    ``dit_steps``; the steps done are recorded, and ``--dit-stop-after`` with them repeats the run."""
    dit_stop_after: int = 0
    """Stop the DiT's training after this many steps (0: at ``dit_steps``), the schedule still that of ``dit_steps``."""
    prompt_dropout: float = 0.1
    ema: float = 0.995
    text_len: int = 32
    """T5 tokens per prompt (``workload.text_len`` of the runs that use the editor)."""
    eval_steps: int = 8
    eval_cfg_scales: tuple = (1.0, 2.5)
    log_every: int = 50


# ---------------------------------------------------------------------------------------------
# Data: random crops of the training pictures, with flips and colour changes


class Crops:
    """Random square crops of the training pictures, resized to a given size, on ``device``.

    Scales (a crop's side is 30-100% of the picture's shorter side), flips, a random order of the colour
    channels for colour pictures and a random tint for grey ones; every choice is drawn from ``gen``.
    """

    def __init__(self, names, device: torch.device, gen: torch.Generator):
        self.pictures = [torch.from_numpy(pictures.load(n)).permute(2, 0, 1).to(device) for n in names]
        self.grey = [pictures.is_grey(pictures.load(n)) for n in names]
        self.gen = gen

    def _uniform(self, low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=self.gen))

    def one(self, size: int) -> torch.Tensor:
        index = int(torch.randint(len(self.pictures), (), generator=self.gen))
        picture = self.pictures[index]
        height, width = picture.shape[-2:]
        side = max(16, int(min(height, width) * self._uniform(0.3, 1.0)))
        top = int(torch.randint(height - side + 1, (), generator=self.gen))
        left = int(torch.randint(width - side + 1, (), generator=self.gen))
        crop = picture[None, :, top:top + side, left:left + side]
        crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        if torch.rand((), generator=self.gen) < 0.5:
            crop = crop.flip(-1)
        if self.grey[index]:
            tint = torch.rand(3, generator=self.gen).to(crop.device) * 0.7 + 0.3
            crop = crop * (tint / tint.max())[None, :, None, None]
        elif torch.rand((), generator=self.gen) < 0.5:
            crop = crop[:, torch.randperm(3, generator=self.gen).to(crop.device)]
        return crop.clamp(0, 1)

    def batch(self, n: int, size: int) -> torch.Tensor:
        """-> [n, 3, size, size] in [0, 1]"""
        return torch.cat([self.one(size) for _ in range(n)])


# ---------------------------------------------------------------------------------------------
# The VAE


def make_vae():
    """A small AutoencoderKL of Flux's kind: 16 latent channels, 8x smaller each way, no quant convs."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 64, 128, 128), layers_per_block=1,
        latent_channels=16, norm_num_groups=32, sample_size=256, scaling_factor=1.0, shift_factor=0.0,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False)


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _gradient_l1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """L1 between the images' horizontal and vertical differences: keeps edges sharp."""
    dx = lambda x: x[..., :, 1:] - x[..., :, :-1]  # noqa: E731
    dy = lambda x: x[..., 1:, :] - x[..., :-1, :]  # noqa: E731
    return (dx(a) - dx(b)).abs().mean() + (dy(a) - dy(b)).abs().mean()


def train_vae(cfg: TrainConfig, crops: Crops, device: torch.device, log) -> "torch.nn.Module":
    vae = make_vae().to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    for step in range(cfg.vae_steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg.vae_steps, cfg.vae_lr, min(cfg.warmup, cfg.vae_steps // 10 + 1))
        x = crops.batch(cfg.vae_batch, cfg.vae_crop) * 2 - 1
        with _autocast(device):
            posterior = vae.encode(x).latent_dist
            z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen, device=device)
            rec = vae.decode(z).sample.float()
        l1 = (rec - x).abs().mean()
        kl = posterior.kl().mean()
        loss = l1 + _gradient_l1(rec, x) + cfg.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.vae_steps - 1:
            log({"phase": "vae", "step": step, "vae/loss": loss.item(), "vae/l1": l1.item(), "vae/kl": kl.item()})
    vae.eval().requires_grad_(False)
    _set_latent_statistics(vae, crops, cfg, device)
    return vae


@torch.no_grad()
def _set_latent_statistics(vae, crops: Crops, cfg: TrainConfig, device: torch.device) -> None:
    """Flux's semantics: latents = (mode - shift_factor) * scaling_factor have mean 0 and deviation 1."""
    latents = torch.cat([vae.encode(crops.batch(16, cfg.size) * 2 - 1).latent_dist.mode() for _ in range(8)])
    shift = latents.mean().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / (latents - shift).std().item())


class Codec:
    """Pixels in [0, 1] <-> Flux latents through the trained VAE (ditrun's ``DiffusersVAE`` semantics)."""

    def __init__(self, vae):
        self.vae = vae
        self.scale, self.shift = vae.config.scaling_factor, vae.config.shift_factor

    @torch.no_grad()
    def encode(self, rgb: torch.Tensor) -> torch.Tensor:
        with _autocast(rgb.device):
            mode = self.vae.encode(rgb * 2 - 1).latent_dist.mode().float()
        return (mode - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        with _autocast(latent.device):
            rgb = self.vae.decode(latent / self.scale + self.shift).sample.float()
        return ((rgb + 1) / 2).clamp(0, 1)


# ---------------------------------------------------------------------------------------------
# The DiT


def make_dit(device: torch.device) -> FluxDiT:
    model = FluxDiT(PRESETS["editor"]).to(device)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(ZERO_INIT) and isinstance(module, torch.nn.Linear):
                module.weight.zero_()
                module.bias.zero_()
    return model


@torch.no_grad()
def encode_prompts(folder: Path, texts: list[str], text_len: int, device: torch.device):
    """Every text through the folder's own encoders, as ditrun encodes a run's prompts (diffusers'
    ``encode_prompt``). -> ([N, text_len, joint_dim], [N, pooled_dim]) fp32 on ``device``"""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(folder, transformer=None, vae=None, torch_dtype=torch.float32,
                                        low_cpu_mem_usage=False)
    pipe.set_progress_bar_config(disable=True)
    embeds, pooled = [], []
    for text in texts:
        e, p, _ = pipe.encode_prompt(prompt=text, prompt_2=None, device=torch.device("cpu"),
                                     max_sequence_length=text_len)
        embeds.append(e[0])
        pooled.append(p[0])
    return torch.stack(embeds).to(device), torch.stack(pooled).to(device)


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def sample_sigmas(n: int, tokens: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Logit-normal noise levels, shifted as Flux's sampler shifts its schedule at ``tokens`` output tokens."""
    u = torch.sigmoid(torch.randn(n, generator=gen, device=device))
    shift = math.exp(time_shift_mu(tokens))
    return shift / (shift + (1 / u - 1))


class Pool:
    """Training edits, encoded once: ``size`` reference crops and every edit's correct output of each, as packed
    latents (bf16), so that a training step spends its time in the DiT, not in the VAE."""

    def __init__(self, cfg: TrainConfig, crops: Crops, codec: Codec, size: int, chunk: int = 64):
        self.names = transforms.EDITS.names()
        refs, targets = [], [[] for _ in self.names]
        for start in range(0, size, chunk):
            ref = crops.batch(min(chunk, size - start), cfg.size)
            refs.append(pack(codec.encode(ref)).bfloat16())
            for kind, name in enumerate(self.names):
                targets[kind].append(pack(codec.encode(transforms.apply(name, ref))).bfloat16())
        self.refs = torch.cat(refs)  # [N, S, 64]
        self.targets = torch.stack([torch.cat(t) for t in targets])  # [edits, N, S, 64]


class Batches:
    """Training edits drawn from a ``Pool``: a reference, an instruction (one phrasing of one edit, sometimes the
    empty prompt) and the correct output."""

    def __init__(self, cfg: TrainConfig, pool: Pool, prompt_index: dict, gen: torch.Generator):
        self.cfg, self.pool, self.gen = cfg, pool, gen
        self.prompt_index = prompt_index  # text -> row of the embedding table

    def draw(self, n: int):
        pool, cfg = self.pool, self.cfg
        picks = torch.randint(pool.refs.shape[0], (n,), generator=self.gen)
        kinds = torch.randint(len(pool.names), (n,), generator=self.gen)
        rows = []
        for kind in kinds.tolist():
            phrasings = transforms.EDITS.get(pool.names[kind], "edit").phrasings
            text = phrasings[int(torch.randint(len(phrasings), (), generator=self.gen))]
            dropped = float(torch.rand((), generator=self.gen)) < cfg.prompt_dropout
            rows.append(self.prompt_index[EMPTY_PROMPT if dropped else text])
        device = pool.refs.device
        picks, kinds = picks.to(device), kinds.to(device)
        return pool.refs[picks].float(), pool.targets[kinds, picks].float(), torch.tensor(rows)


def train_dit(cfg: TrainConfig, batches: Batches, table, device: torch.device, log):
    embeds, pooled = table
    model = make_dit(device).train()
    ema = make_dit(device).eval().requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.dit_lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 2)
    latent = cfg.size // 8
    ids = torch.cat([token_ids(latent, latent, 0, device), token_ids(latent, latent, 1, device)])
    txt_ids = torch.zeros(cfg.text_len, 3, device=device)
    n_img = (latent // 2) ** 2
    start = time.perf_counter()
    for step in range(cfg.dit_steps):
        if cfg.dit_time_limit_s and time.perf_counter() - start > cfg.dit_time_limit_s:
            print(f"train: DiT stopped by --dit-time-limit-s after {step} steps", flush=True)
            return ema, step
        if step == cfg.dit_stop_after > 0:
            return ema, step
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg.dit_steps, cfg.dit_lr, cfg.warmup)
        ref, x0, rows = batches.draw(cfg.dit_batch)
        rows = rows.to(device)
        sigma = sample_sigmas(x0.shape[0], n_img, gen, device)
        noise = torch.randn(x0.shape, generator=gen, device=device)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        with _autocast(device), _attention_backend(device):
            v = model(hidden_states=torch.cat([xt, ref], dim=1), encoder_hidden_states=embeds[rows],
                      pooled_projections=pooled[rows], timestep=sigma, img_ids=ids, txt_ids=txt_ids)[:, :n_img]
        loss = F.mse_loss(v.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(cfg.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)
        if step % cfg.log_every == 0 or step == cfg.dit_steps - 1:
            log({"phase": "dit", "step": step, "dit/loss": loss.item(), "dit/grad_norm": grad.item(),
                 "dit/lr": opt.param_groups[0]["lr"]})
    return ema, cfg.dit_steps


def _attention_backend(device: torch.device):
    """The math backend on GPUs: its backward is deterministic (the fused kernels' are not)."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH) if device.type == "cuda" else nullcontext()


# ---------------------------------------------------------------------------------------------
# Judging: SSIM against the correct edit on held-out pictures, sampled as ditrun samples


def held_out_references(size: int, device: torch.device, names=pictures.HELD_OUT) -> torch.Tensor:
    """The held-out pictures resized to size x size, as a run's references are (8-bit, PIL Lanczos)."""
    from PIL import Image

    out = []
    for name in names:
        rgb8 = np.round(pictures.load(name) * 255).astype(np.uint8)
        img = np.asarray(Image.fromarray(rgb8).resize((size, size), resample=Image.LANCZOS), dtype=np.float32) / 255
        out.append(torch.from_numpy(img).permute(2, 0, 1))
    return torch.stack(out).to(device)


@torch.no_grad()
def sample_edits(model, codec: Codec, refs: torch.Tensor, prompt, negative, steps: int, cfg_scale: float,
                 seed: int) -> torch.Tensor:
    """One edit of each reference with ditrun's sampler (``denoise`` + true CFG), noise seeded as a run's.

    refs: [B, 3, S, S] in [0, 1]; prompt, negative: ([L, D], [P]) -> [B, 3, S, S] in [0, 1]
    """
    from ditrun.workload import initial_noise

    batch, device, latent = refs.shape[0], refs.device, refs.shape[-1] // 8
    dtype = next(model.parameters()).dtype
    noise = torch.cat([initial_noise(seed + i, latent, latent, dtype) for i in range(batch)]).to(device)
    inputs = EditInputs(
        noise=noise, ref_latents=pack(codec.encode(refs)), img_ids=token_ids(latent, latent, 0, device),
        ref_ids=token_ids(latent, latent, 1, device), prompt=prompt[0].expand(batch, -1, -1),
        pooled=prompt[1].expand(batch, -1), txt_ids=torch.zeros(prompt[0].shape[0], 3, device=device))
    if cfg_scale > 1:
        inputs.neg_prompt, inputs.neg_pooled = negative[0].expand(batch, -1, -1), negative[1].expand(batch, -1)
    velocity = sequential_cfg_velocity(model, inputs, cfg_scale, None, dtype)
    latents = denoise(velocity, inputs.noise, steps)
    return codec.decode(unpack(latents, latent, latent))


def _ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """SSIM of two [3, H, W] images in [0, 1] as a run measures it: 8-bit pictures, RGB, data range 1."""
    from ditrun.metrics.quality import ssim

    to8 = lambda x: np.round(x.permute(1, 2, 0).float().cpu().numpy() * 255).astype(np.uint8)  # noqa: E731
    return ssim(to8(a), to8(b))


def evaluate(model, codec: Codec, table, prompt_index: dict, cfg: TrainConfig, device: torch.device,
             names=pictures.HELD_OUT) -> dict:
    """SSIM against the correct edit, per instruction (its first phrasing) and picture, per CFG scale;
    also the VAE's own round trip, the ceiling of any edit."""
    refs = held_out_references(cfg.size, device, names)
    embeds, pooled = table
    row = lambda text: (embeds[prompt_index[text]], pooled[prompt_index[text]])  # noqa: E731
    result = {"pictures": list(names), "steps": cfg.eval_steps, "vae_roundtrip": {}, "edits": {}}
    for name, rec in zip(names, codec.decode(codec.encode(refs))):
        result["vae_roundtrip"][name] = _ssim(rec, refs[names.index(name)])
    for scale in cfg.eval_cfg_scales:
        per_edit = {}
        for edit_name, edit in transforms.EDITS.items():
            out = sample_edits(model, codec, refs, row(edit.phrasings[0]), row(EMPTY_PROMPT), cfg.eval_steps, scale,
                               cfg.seed)
            target = edit.transform(refs)
            per_edit[edit_name] = {n: _ssim(o, t) for n, o, t in zip(names, out, target)}
        result["edits"][f"true_cfg_scale={scale:g}"] = per_edit
    return result


# ---------------------------------------------------------------------------------------------
# The run


class Log:
    """Losses to ``losses.jsonl`` and, when W&B is installed, to an offline W&B run (as a ditrun run logs)."""

    def __init__(self, log_dir: Path, cfg: TrainConfig):
        self.file = (log_dir / "losses.jsonl").open("w")
        self.start = time.perf_counter()
        self.run = None
        try:
            import wandb

            from ditrun.metrics.wandb import OFFLINE_ENVIRONMENT
        except ImportError:
            print("train: wandb is not installed; losses go to losses.jsonl only", flush=True)
            return
        os.environ.update(OFFLINE_ENVIRONMENT)
        self.run = wandb.init(project="ditrun", job_type="train-editor", dir=str(log_dir), mode="offline",
                              config=dataclasses.asdict(cfg))

    def __call__(self, row: dict) -> None:
        row = {**row, "elapsed_s": round(time.perf_counter() - self.start, 2)}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if k != "phase"})
        if row["step"] % 500 == 0:
            print("train:", json.dumps(row), flush=True)

    def finish(self, summary: dict, exit_code: int = 0) -> None:
        self.file.close()
        if self.run is not None:
            self.run.summary.update(summary)
            self.run.finish(exit_code=exit_code)


def save_folder(out: Path, vae, dit: FluxDiT) -> None:
    from ditrun.model.load import save_pretrained

    vae.half().save_pretrained(out / "vae", safe_serialization=True)
    save_pretrained(dit.to(torch.bfloat16), out / "transformer")


def load_vae(path: Path, device: torch.device):
    """A VAE this script trained before (its ``vae/`` folder), to train only the DiT."""
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(path, low_cpu_mem_usage=False).float().to(device).eval().requires_grad_(False)


def train(cfg: TrainConfig, out: Path, log_dir: Path, device: torch.device, vae_from: Optional[Path] = None) -> dict:
    """Train and write the folder; returns the evaluation (also in ``log_dir/eval.json``). ``vae_from`` takes the
    VAE of an earlier run of this script instead of training one."""
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    parts.write_text_parts(out, cfg.seed, cfg.text_len)
    log = Log(log_dir, cfg)
    try:
        times = {}
        gen = torch.Generator().manual_seed(cfg.seed)
        crops = Crops(pictures.TRAIN, device, gen)
        start = time.perf_counter()
        vae = load_vae(vae_from, device) if vae_from else train_vae(cfg, crops, device, log)
        times["vae_s"] = time.perf_counter() - start
        texts = [EMPTY_PROMPT] + transforms.prompts()
        table = encode_prompts(out, texts, cfg.text_len, device)
        prompt_index = {text: i for i, text in enumerate(texts)}
        codec = Codec(vae)
        start = time.perf_counter()
        pool = Pool(cfg, crops, codec, cfg.pool)
        times["pool_s"] = time.perf_counter() - start
        dit, times["dit_steps"] = train_dit(cfg, Batches(cfg, pool, prompt_index, gen), table, device, log)
        times["dit_s"] = time.perf_counter() - start - times["pool_s"]
        start = time.perf_counter()
        result = evaluate(dit, codec, table, prompt_index, cfg, device)
        times["eval_s"] = time.perf_counter() - start
        save_folder(out, vae, dit)
        record = {"config": dataclasses.asdict(cfg), "vae_from": str(vae_from) if vae_from else None, "times": times,
                  "device": _device_name(device),
                  "versions": _versions()}
        (log_dir / "train.json").write_text(json.dumps(record, indent=2) + "\n")
        print("train: seconds", {k: round(v, 1) for k, v in times.items()}, flush=True)
        (log_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    except BaseException:
        log.finish({}, exit_code=1)  # the losses so far stay readable; the W&B run ends as failed
        raise
    log.finish({"eval/" + k: v for k, v in summarize(result).items()})
    return result


def summarize(result: dict) -> dict:
    """Median SSIM against the correct edit over pictures, per CFG setting and instruction."""
    out = {}
    for setting, per_edit in result["edits"].items():
        for name, by_picture in per_edit.items():
            out[f"{setting}/{name}"] = float(np.median(list(by_picture.values())))
    return out


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _versions() -> dict:
    import diffusers
    import transformers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the pipeline folder to write")
    parser.add_argument("--log-dir", type=Path, help="losses, evaluation and W&B run (default: <out>.training)")
    parser.add_argument("--vae-from", type=Path, help="a vae/ folder this script wrote: train only the DiT")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for f in dataclasses.fields(TrainConfig):
        if f.type in ("int", "float"):
            parser.add_argument("--" + f.name.replace("_", "-"), type={"int": int, "float": float}[f.type],
                                default=f.default)
    args = parser.parse_args(argv)
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    cfg = TrainConfig(**settings)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, read at CUDA's start
    result = train(cfg, args.out, args.log_dir or args.out.with_name(args.out.name + ".training"),
                   torch.device(args.device), args.vae_from)
    for key, value in summarize(result).items():
        print(f"eval {key}: SSIM {value:.4f}")
    print("vae round trip: SSIM", {k: round(v, 4) for k, v in result["vae_roundtrip"].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
