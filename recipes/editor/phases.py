"""The two training phases (the VAE, then the DiT) behind one loop that logs, measures, checkpoints and stops on
the time budget. A phase's step draws its random numbers outside the compiled function and leaves every value on
the device (the loss is read only when it is logged), so that ``torch.compile`` and CUDA graphs can take it."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from recipes.editor import evaluate
from recipes.editor.checkpoint import Checkpoints, generator_states, restore_generators
from recipes.editor.config import TrainConfig, edit_weights
from recipes.editor.data import Batches, Crops, DeadLeaves, vae_batch
from recipes.editor.dit import attention_backend, dit_loss, make_dit, positions, sample_sigmas
from recipes.editor.vae import Codec, load_vae, make_vae, set_latent_statistics, vae_loss

# --compile: how each phase's loss (forward and, through AOT autograd, backward) is compiled. "auto" is inductor on
# CUDA, where eager steps are bound by the host's cost per operation, and eager elsewhere: inductor's code
# generation takes minutes on a CPU, longer than the CPU trainings it would speed up.
COMPILE_MODES = {
    "auto": None,
    "off": None,
    "inductor": {},
    "inductor-cudagraphs": {"mode": "reduce-overhead"},  # CUDA graphs: no host cost per kernel
    "aot_eager": {"backend": "aot_eager"},  # traces as inductor does, without code generation: a quick check
}


def compiled(fn, mode: str, device: torch.device):
    """``fn`` compiled as ``--compile`` asks; CUDA graphs need CUDA, so elsewhere inductor alone."""
    if mode == "auto":
        mode = "inductor" if device.type == "cuda" else "off"
    if mode == "inductor-cudagraphs" and device.type != "cuda":
        print("train: --compile inductor-cudagraphs needs CUDA; compiling with inductor alone", flush=True)
        mode = "inductor"
    options = COMPILE_MODES[mode]
    return fn if options is None else torch.compile(fn, dynamic=False, **options)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine down to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Stopped(Exception):
    """The time budget ran out; the phase's state is in its checkpoint."""

    def __init__(self, phase: str, step: int):
        super().__init__(f"{phase} phase stopped after {step} steps")
        self.phase, self.step = phase, step


class VaePhase:
    name = "vae"

    def __init__(self, cfg: TrainConfig, crops: Crops, device: torch.device, compile_mode: str):
        self.cfg, self.crops, self.device = cfg, crops, device
        self.leaves = DeadLeaves(crops, cfg.seed + 3) if cfg.dead_leaves else None
        self.weights = edit_weights(cfg.edit_weights)
        if cfg.init:  # the folder's VAE; only its decoder trains, so that its latents stay what they were
            self.model = load_vae(Path(cfg.init) / "vae", device).train()
            self.model.decoder.requires_grad_(True)
        else:  # initial weights from torch's global generator, where the text encoders left it (train() seeded it)
            self.model = make_vae(cfg).to(device).train()
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trained, lr=cfg.vae_lr, betas=(0.9, 0.99), weight_decay=0.0, foreach=True)
        self.noise = torch.Generator(device=device).manual_seed(cfg.seed + 1)
        self.loss = compiled(vae_loss, compile_mode, device)
        self.cudagraphs = compile_mode == "inductor-cudagraphs"
        self.last = cfg.vae_steps
        self.refs = evaluate.reference_pictures(cfg.size, device, cfg.eval_pictures) if cfg.eval_every else None

    def step(self, step: int) -> dict:
        cfg = self.cfg
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(step, cfg.vae_steps, cfg.vae_lr, min(cfg.warmup, cfg.vae_steps // 10 + 1))
        x = vae_batch(
            self.crops, self.leaves, cfg.vae_batch, cfg.vae_crop, cfg.dead_leaves, cfg.vae_edited, self.weights
        )
        x = x * 2 - 1
        latent = cfg.vae_crop // 8
        eps = torch.randn((cfg.vae_batch, 16, latent, latent), generator=self.noise, device=self.device)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        terms = self.loss(self.model, x, eps, cfg)
        self.opt.zero_grad(set_to_none=True)
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.opt.param_groups[0]["params"], 1.0)
        self.opt.step()
        return terms

    def generators(self) -> dict:
        return {"data": self.crops.gen, "noise": self.noise}

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "done": False,
            "generators": generator_states(self.generators()),
        }

    def restore(self, saved: dict) -> int:
        self.model.load_state_dict(saved["model"])
        if not saved["done"]:
            self.opt.load_state_dict(saved["optimizer"])
        restore_generators(self.generators(), saved["generators"])
        return saved["step"]

    def measure(self) -> dict:
        """The held-out round trip's median PSNR and SSIM."""
        self.model.eval()
        trip = evaluate.roundtrip(Codec(self.model), self.refs, self.cfg.eval_pictures)
        self.model.train()
        return {
            "vae/eval_psnr": float(np.median([t["psnr"] for t in trip.values()])),
            "vae/eval_ssim": float(np.median([t["ssim"] for t in trip.values()])),
        }

    def finish(self):
        """The trained VAE, frozen, with Flux's latent statistics (drawn from the data generator; an ``init``
        folder's own, as its encoder did not change)."""
        self.model.eval().requires_grad_(False)
        if not self.cfg.init:
            set_latent_statistics(self.model, self.crops, self.cfg)
        return self.model

    def finished_state(self) -> dict:
        config = self.model.config
        return {
            "model": self.model.state_dict(),
            "done": True,
            "step": self.last,
            "latent_statistics": [config.shift_factor, config.scaling_factor],
            "generators": generator_states(self.generators()),
        }

    def restore_finished(self, saved: dict):
        self.restore(saved)
        shift, scale = saved["latent_statistics"]
        self.model.register_to_config(shift_factor=shift, scaling_factor=scale)
        return self.model.eval().requires_grad_(False)


class DitPhase:
    name = "dit"

    def __init__(
        self,
        cfg: TrainConfig,
        batches: Batches,
        table,
        codec: Codec,
        device: torch.device,
        compile_mode: str,
        pool_state: torch.Tensor,
    ):
        self.cfg, self.batches, self.table, self.codec, self.device = cfg, batches, table, codec, device
        self.pool_state = pool_state  # the data generator's state when the pool was drawn: a resumption redraws it
        self.model = make_dit(device, cfg.init).train()
        self.ema = make_dit(device).eval().requires_grad_(False)
        self.ema.load_state_dict(self.model.state_dict())
        # fused: one kernel for the update rather than a few per tensor (CUDA; foreach, as eager always was, elsewhere)
        fused = device.type == "cuda" and compile_mode != "off"
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.dit_lr,
            betas=(0.9, 0.99),
            weight_decay=0.0,
            fused=fused or None,
            foreach=None if fused else True,
        )
        self.noise = torch.Generator(device=device).manual_seed(cfg.seed + 2)
        self.loss = compiled(dit_loss, compile_mode, device)
        self.cudagraphs = compile_mode == "inductor-cudagraphs"
        self.ids, self.txt_ids = positions(cfg.size, cfg.text_len, device)
        self.last = cfg.dit_last_step
        self.refs = evaluate.reference_pictures(cfg.size, device, cfg.eval_pictures) if cfg.eval_every else None

    def step(self, step: int) -> dict:
        cfg, embeds, pooled = self.cfg, *self.table
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(step, cfg.dit_steps, cfg.dit_lr, cfg.warmup)
        ref, x0, rows = self.batches.draw(cfg.dit_batch)
        rows = rows.to(self.device)
        sigma = sample_sigmas(x0.shape[0], x0.shape[1], self.noise, self.device)
        noise = torch.randn(x0.shape, generator=self.noise, device=self.device)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with attention_backend(self.device):
            loss = self.loss(self.model, xt, ref, embeds[rows], pooled[rows], sigma, noise - x0, self.ids, self.txt_ids)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        decay = min(cfg.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(list(self.ema.parameters()), list(self.model.parameters()), 1 - decay)
        return {"loss": loss, "grad_norm": grad, "lr": self.opt.param_groups[0]["lr"]}

    def generators(self) -> dict:
        return {"data": self.batches.gen, "noise": self.noise}

    def state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "optimizer": self.opt.state_dict(),
            "pool_state": self.pool_state,
            "generators": generator_states(self.generators()),
        }

    def restore(self, saved: dict) -> int:
        self.model.load_state_dict(saved["model"])
        self.ema.load_state_dict(saved["ema"])
        self.opt.load_state_dict(saved["optimizer"])
        restore_generators(self.generators(), saved["generators"])
        return saved["step"]

    def measure(self) -> dict:
        """Median PSNR against the correct edit and median margin over the naive candidates (EMA, last CFG scale),
        over all edits and per instruction (``dit/eval_margin/<edit>``), and the lowest instruction's median
        margin (``dit/eval_margin_lowest``: what the editor's every-instruction target reads)."""
        embeds, pooled = self.table
        index = self.batches.prompt_index
        per_edit = evaluate.edits(
            self.ema,
            self.codec,
            self.refs,
            self.cfg.eval_pictures,
            lambda text: (embeds[index[text]], pooled[index[text]]),
            self.cfg.eval_cfg_scales[-1],
            self.cfg.eval_steps,
            self.cfg.seed,
        )
        summary = evaluate.summarize(per_edit)
        overall = summary.pop("all")
        margins = {name: row["margin_median"] for name, row in summary.items() if row["margin_median"] is not None}
        return {
            "dit/eval_psnr": overall["psnr_median"],
            "dit/eval_margin": overall["margin_median"],
            "dit/eval_beat_all": overall["beat_all"] / max(1, overall["counted"]),
            "dit/eval_margin_lowest": min(margins.values(), default=None),
            **{f"dit/eval_margin/{name}": margin for name, margin in margins.items()},
        }


class Budget:
    """What this command may spend training: ``--max-minutes`` of wall-clock time from its start and ``--max-steps``
    steps over both phases (0: no limit)."""

    def __init__(self, minutes: float, steps: int):
        self.deadline = time.monotonic() + minutes * 60 if minutes else None
        self.steps_left = steps or None

    def spent(self) -> bool:
        return self.steps_left == 0 or (self.deadline is not None and time.monotonic() >= self.deadline)

    def take_step(self) -> None:
        if self.steps_left is not None:
            self.steps_left -= 1


def _scalar(value) -> float:
    """A logged term as a float (a tensor read without its graph)."""
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def run_phase(phase, start: int, cfg: TrainConfig, checkpoints: Checkpoints, every: int, budget: Budget, log) -> None:
    """Steps ``start`` .. ``phase.last`` - 1: log every ``cfg.log_every``, measure every ``cfg.eval_every``,
    checkpoint every ``every`` and at the end; when the budget is spent, checkpoint and raise ``Stopped``."""
    for step in range(start, phase.last):
        if budget.spent():
            checkpoints.save(phase.name, {**phase.state(), "step": step})
            raise Stopped(phase.name, step)
        terms = phase.step(step)
        budget.take_step()
        if step % cfg.log_every == 0 or step == phase.last - 1:
            log({"phase": phase.name, "step": step, **{f"{phase.name}/{k}": _scalar(v) for k, v in terms.items()}})
        done = step + 1
        if cfg.eval_every and done % cfg.eval_every == 0:
            log({"phase": phase.name, "step": step, **phase.measure()})
        if done == phase.last or (every and done % every == 0):
            checkpoints.save(phase.name, {**phase.state(), "step": done})
