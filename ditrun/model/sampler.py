"""Flow-matching Euler sampling with the Flux time shift, true CFG and Kontext-style editing.

An edit's model input is the noisy output latent followed by the reference image's latent
tokens; the reference tokens carry position ids on the reference's own grid whose first axis is
1 (the Kontext convention), and only the output tokens' velocity is used. As in diffusers, true
CFG runs the unconditional branch only when it changes the result (``true_cfg_scale`` > 1). The sampler does not
know how a velocity is computed: a *layout* (one process, Ulysses, split or batched CFG) supplies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from ditrun.errors import UserError

# (x [B, S_img, C] fp32, sigma) -> guided velocity [B, S_img, C] fp32
VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]


@dataclass
class EditInputs:
    """Everything the DiT needs for one edit, already on the compute device."""

    noise: torch.Tensor
    """[1, S_img, 64] fp32 initial latent tokens."""
    ref_latents: torch.Tensor
    """[1, S_ref, 64] reference image latent tokens."""
    img_ids: torch.Tensor
    """[S_img, 3] position ids of the output tokens (first axis 0)."""
    ref_ids: torch.Tensor
    """[S_ref, 3] position ids of the reference tokens (first axis 1), on the reference's own grid."""
    prompt: torch.Tensor
    """[1, L, joint_dim] conditional text embedding."""
    pooled: torch.Tensor
    """[1, pooled_dim] conditional pooled embedding."""
    txt_ids: torch.Tensor
    """[L, 3] text position ids (all zero in Flux)."""
    neg_prompt: Optional[torch.Tensor] = None
    """[1, L, joint_dim] unconditional (negative prompt) text embedding; None when true CFG is off."""
    neg_pooled: Optional[torch.Tensor] = None
    """[1, pooled_dim] unconditional pooled embedding; None when true CFG is off."""

    @property
    def true_cfg(self) -> bool:
        """Whether each step also runs the unconditional branch."""
        return self.neg_prompt is not None

    @property
    def model_ids(self) -> torch.Tensor:
        """Position ids of the model's image input: output tokens, then reference tokens."""
        return torch.cat([self.img_ids, self.ref_ids], dim=0)


def time_shift_mu(
    image_seq_len: int, base_len: int = 256, max_len: int = 4096, base_shift: float = 0.5, max_shift: float = 1.15
) -> float:
    """Flux's resolution-dependent shift: linear in the output token count."""
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + base_shift - slope * base_len


def flux_sigmas(steps: int, image_seq_len: int) -> list[float]:
    """Noise levels from 1 to 0: ``steps`` shifted levels, then a final 0."""
    if steps < 1:
        raise UserError(f"workload.steps={steps} must be at least 1.")
    mu = time_shift_mu(image_seq_len)
    raw = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    shifted = math.exp(mu) / (math.exp(mu) + (1.0 / raw - 1.0))
    return shifted.tolist() + [0.0]


def branch_inputs(
    inputs: EditInputs, x: torch.Tensor, sigma: float, conditional: bool, dtype: torch.dtype, guidance: Optional[float]
) -> dict:
    """Keyword inputs of one CFG branch for ``FluxDiT.forward``."""
    hidden = torch.cat([x, inputs.ref_latents.to(x.dtype)], dim=1).to(dtype)
    batch = hidden.shape[0]
    t = torch.full((batch,), sigma, device=x.device, dtype=torch.float32)
    return dict(
        hidden_states=hidden,
        encoder_hidden_states=(inputs.prompt if conditional else inputs.neg_prompt).to(dtype),
        pooled_projections=(inputs.pooled if conditional else inputs.neg_pooled).to(dtype),
        timestep=t,
        img_ids=inputs.model_ids,
        txt_ids=inputs.txt_ids,
        guidance=None if guidance is None else torch.full_like(t, guidance),
    )


def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """True classifier-free guidance."""
    return uncond + scale * (cond - uncond)


class Forward(Protocol):
    """One DiT forward of one CFG branch: ``cond``, ``uncond``, or ``both`` (the two stacked in one batch).

    ``PlainForward`` runs every branch alike (the module, or its forward replayed from CUDA graphs); the step cache
    (``ditrun/cache``) keeps one state per branch, which is why the branch is named."""

    def __call__(self, branch: str, **inputs) -> torch.Tensor: ...


@dataclass(frozen=True)
class PlainForward:
    """``run(**inputs)`` for every branch: the DiT module, or its CUDA-graphed replay (``model/graphs.py``)."""

    run: Callable[..., torch.Tensor]

    def __call__(self, branch: str, **inputs) -> torch.Tensor:
        return self.run(**inputs)


def sequential_cfg_velocity(
    model: Callable[..., torch.Tensor],
    inputs: EditInputs,
    true_cfg_scale: float,
    guidance: Optional[float],
    dtype: torch.dtype,
    attention=None,
) -> VelocityFn:
    """``sequential_branches`` of a plain model (``model(**inputs)``, every branch alike)."""
    return sequential_branches(PlainForward(model), inputs, true_cfg_scale, guidance, dtype, attention)


def sequential_branches(
    forward: Forward,
    inputs: EditInputs,
    true_cfg_scale: float,
    guidance: Optional[float],
    dtype: torch.dtype,
    attention=None,
) -> VelocityFn:
    """Velocity on one process: the conditional, then (true CFG on) the unconditional branch (layout ``single``)."""
    n_img = inputs.noise.shape[1]
    extra = {} if attention is None else {"attention": attention}

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        cond = forward("cond", **branch_inputs(inputs, x, sigma, True, dtype, guidance), **extra)
        cond = cond[:, :n_img].float()
        if not inputs.true_cfg:
            return cond
        uncond = forward("uncond", **branch_inputs(inputs, x, sigma, False, dtype, guidance), **extra)
        uncond = uncond[:, :n_img].float()
        return combine_cfg(cond, uncond, true_cfg_scale)

    return velocity


def denoise(
    velocity: VelocityFn, noise: torch.Tensor, steps: int, on_step: Optional[Callable[[int], None]] = None
) -> torch.Tensor:
    """Euler integration of the flow from noise (sigma=1) to data (sigma=0), in fp32."""
    sigmas = flux_sigmas(steps, noise.shape[1])
    x = noise.float()
    for i in range(steps):
        v = velocity(x, sigmas[i])
        x = x + (sigmas[i + 1] - sigmas[i]) * v
        if on_step is not None:
            on_step(i)
    return x
