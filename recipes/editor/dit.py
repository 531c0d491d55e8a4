"""The editor's DiT: ditrun's own ``FluxDiT`` in the ``editor`` geometry, trained with rectified flow exactly as
ditrun samples (``x_t = (1 - sigma) x_0 + sigma * noise``, velocity ``noise - x_0``, sigma logit-normal with Flux's
resolution shift), conditioned Kontext-style on the reference's latent tokens placed after the output's."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from ditrun.editor import transforms
from ditrun.model.dit import FluxDiT
from ditrun.model.latents import token_ids
from ditrun.model.presets import PRESETS
from ditrun.model.sampler import time_shift_mu
from recipes.editor.data import EMPTY_PROMPT
from recipes.editor.vae import autocast

# Zero-initialised so that every block starts as the identity and the model's output as zero (adaLN-zero).
ZERO_INIT = ("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear", "proj_out")


def make_dit(device: torch.device, init: str = "") -> FluxDiT:
    """The editor's DiT in fp32: the ``init`` pipeline folder's transformer, or adaLN-zero from torch's generator."""
    if init:
        from ditrun.model.load import from_pretrained

        return from_pretrained(Path(init) / "transformer", torch.float32, device).requires_grad_(True)
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

    pipe = FluxPipeline.from_pretrained(
        folder, transformer=None, vae=None, torch_dtype=torch.float32, low_cpu_mem_usage=False
    )
    pipe.set_progress_bar_config(disable=True)
    embeds, pooled = [], []
    for text in texts:
        e, p, _ = pipe.encode_prompt(
            prompt=text, prompt_2=None, device=torch.device("cpu"), max_sequence_length=text_len
        )
        embeds.append(e[0])
        pooled.append(p[0])
    return torch.stack(embeds).to(device), torch.stack(pooled).to(device)


def prompt_table(folder: Path, text_len: int, device: torch.device) -> tuple[tuple, dict]:
    """The empty prompt and every instruction's phrasings through the folder's encoders (``encode_prompts``), with
    each text's row. -> ((embeds, pooled), {text: row})"""
    texts = [EMPTY_PROMPT] + transforms.prompts()
    return encode_prompts(folder, texts, text_len, device), {text: i for i, text in enumerate(texts)}


def sample_sigmas(n: int, tokens: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Logit-normal noise levels, shifted as Flux's sampler shifts its schedule at ``tokens`` output tokens."""
    u = torch.sigmoid(torch.randn(n, generator=gen, device=device))
    shift = math.exp(time_shift_mu(tokens))
    return shift / (shift + (1 / u - 1))


def attention_backend(device: torch.device):
    """The math backend on GPUs: its backward is deterministic (the fused kernels' are not)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH) if device.type == "cuda" else nullcontext()


def positions(size: int, text_len: int, device: torch.device):
    """Position ids of the output's tokens then the reference's (first axis 1), and of the text tokens."""
    latent = size // 8
    ids = torch.cat([token_ids(latent, latent, 0, device), token_ids(latent, latent, 1, device)])
    return ids, torch.zeros(text_len, 3, device=device)


def dit_loss(model, xt, ref, embeds, pooled, sigma, target, ids, txt_ids) -> torch.Tensor:
    """MSE of the predicted velocity on the output's tokens; every random draw is an input, so that it compiles.

    xt, ref, target: [B, S, 64]; embeds: [B, L, D]; pooled: [B, P]; sigma: [B]; ids: [2S, 3]; txt_ids: [L, 3]
    """
    with autocast(xt.device):
        v = model(
            hidden_states=torch.cat([xt, ref], dim=1),
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=sigma,
            img_ids=ids,
            txt_ids=txt_ids,
        )[:, : xt.shape[1]]
    return F.mse_loss(v.float(), target)
