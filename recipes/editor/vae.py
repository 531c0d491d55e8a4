"""The editor's VAE: Flux's kind of ``AutoencoderKL`` (16 latent channels, 8x smaller each way), its losses, its
training step, and the codec that turns pixels into Flux latents through it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.editor.config import TrainConfig


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def make_vae(cfg: TrainConfig):
    """An AutoencoderKL of Flux's kind: 16 latent channels, 8x smaller each way, no quant convs, no attention."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=tuple(cfg.vae_widths),
        layers_per_block=cfg.vae_layers,
        latent_channels=16,
        norm_num_groups=cfg.vae_norm_groups,
        sample_size=256,
        scaling_factor=1.0,
        shift_factor=0.0,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )


def encoder_weights(weights: dict) -> dict:
    """The entries of a VAE's weights (a state dict or a safetensors file's tensors) that make its latents: the
    encoder's (the decoder does not touch them)."""
    return {k: v for k, v in weights.items() if k.startswith("encoder.")}


def load_vae(path: Path, device: torch.device):
    """A VAE this recipe trained before (a ``vae/`` folder), frozen, in fp32. Built again from its settings, as
    ``from_pretrained`` records the path it read in the config, which a folder written from it must not carry."""
    from diffusers import AutoencoderKL

    loaded = AutoencoderKL.from_pretrained(path, low_cpu_mem_usage=False)
    vae = AutoencoderKL(**{k: v for k, v in loaded.config.items() if not k.startswith("_")})
    vae.load_state_dict(loaded.state_dict())
    return vae.float().to(device).eval().requires_grad_(False)


def gradient_l1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """L1 between the images' horizontal and vertical differences: keeps edges sharp."""
    dx = lambda x: x[..., :, 1:] - x[..., :, :-1]  # noqa: E731
    dy = lambda x: x[..., 1:, :] - x[..., :-1, :]  # noqa: E731
    return (dx(a) - dx(b)).abs().mean() + (dy(a) - dy(b)).abs().mean()


def ssim_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 - SSIM (Gaussian window of 11, sigma 1.5, per channel, data range 1), pixels in [-1, 1]."""
    a, b = (a + 1) / 2, (b + 1) / 2
    x = torch.arange(11, dtype=a.dtype, device=a.device) - 5
    window = torch.exp(-(x**2) / (2 * 1.5**2))
    window = (window / window.sum()).repeat(3, 1, 1, 1)  # [3, 1, 1, 11]

    def blur(image):
        return F.conv2d(F.conv2d(image, window, groups=3), window.transpose(-1, -2), groups=3)

    mean_a, mean_b = blur(a), blur(b)
    var_a, var_b = blur(a * a) - mean_a**2, blur(b * b) - mean_b**2
    covariance = blur(a * b) - mean_a * mean_b
    c1, c2 = 0.01**2, 0.03**2
    numerator = (2 * mean_a * mean_b + c1) * (2 * covariance + c2)
    ssim = numerator / ((mean_a**2 + mean_b**2 + c1) * (var_a + var_b + c2))
    return 1 - ssim.mean()


SECOND_TERMS = {"l1+mse": ("mse", F.mse_loss), "l1+ssim": ("ssim", ssim_loss), "l1+gradient": ("gradient", gradient_l1)}


def vae_loss(vae, x: torch.Tensor, eps: torch.Tensor, cfg: TrainConfig) -> dict:
    """One batch's loss; the posterior's sample noise ``eps`` is drawn outside, so that the function compiles.

    x: [B, 3, C, C] in [-1, 1]; eps: [B, 16, C/8, C/8] -> {"loss", "l1", <second term>, "kl"} (0-dim tensors)
    """
    with autocast(x.device):
        posterior = vae.encode(x).latent_dist
        rec = vae.decode(posterior.mean + posterior.std * eps).sample.float()
    name, term = SECOND_TERMS[cfg.vae_loss]
    l1, second, kl = (rec - x).abs().mean(), term(rec, x), posterior.kl().mean()
    return {"loss": l1 + cfg.vae_loss_weight * second + cfg.vae_kl * kl, "l1": l1, name: second, "kl": kl}


@torch.no_grad()
def set_latent_statistics(vae, crops, cfg: TrainConfig) -> None:
    """Flux's semantics: latents = (mode - shift_factor) * scaling_factor have mean 0 and deviation 1."""
    latents = torch.cat([vae.encode(crops.batch(16, cfg.size) * 2 - 1).latent_dist.mode() for _ in range(8)])
    shift = latents.mean().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / (latents - shift).std().item())


class Codec:
    """Pixels in [0, 1] <-> Flux latents through the VAE (ditrun's ``DiffusersVAE`` semantics)."""

    def __init__(self, vae):
        self.vae = vae
        self.scale, self.shift = vae.config.scaling_factor, vae.config.shift_factor

    @torch.no_grad()
    def encode(self, rgb: torch.Tensor) -> torch.Tensor:
        with autocast(rgb.device):
            mode = self.vae.encode(rgb * 2 - 1).latent_dist.mode().float()
        return (mode - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        with autocast(latent.device):
            rgb = self.vae.decode(latent / self.scale + self.shift).sample.float()
        return ((rgb + 1) / 2).clamp(0, 1)
