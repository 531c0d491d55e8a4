"""Pixels <-> latents <-> packed tokens.

Without VAE weights, a fixed linear map stands in for the autoencoder so that every run writes
a viewable image: ``encode`` averages each 8x8 pixel block of the image scaled to [-1, 1] and
maps its 3 colour values into 16 latent channels with ``LATENT_BASIS`` (a 16x3 matrix whose
orthonormal columns are DCT-II basis vectors 1..3 over 16 points); ``decode`` applies the
transpose (the exact inverse on the map's range) and upsamples 8x bilinearly. With a diffusers
``AutoencoderKL`` folder, the real VAE is used instead (Flux's scaling and shift factors).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ditrun.model import autoencoder

LATENT_CHANNELS = 16
VAE_SCALE = 8


def _latent_basis() -> torch.Tensor:
    n = LATENT_CHANNELS
    c = torch.arange(n, dtype=torch.float64)[:, None]
    k = torch.arange(1, 4, dtype=torch.float64)[None]
    return (math.sqrt(2.0 / n) * torch.cos(math.pi * (c + 0.5) * k / n)).float()  # [16, 3]


LATENT_BASIS = _latent_basis()


class LinearLatentMap:
    """The documented stand-in for a VAE (see module docstring)."""

    def encode(self, rgb: torch.Tensor) -> torch.Tensor:
        # rgb: [1, 3, H, W] in [0, 1] -> [1, 16, H/8, W/8]
        pooled = F.avg_pool2d(rgb.float() * 2 - 1, VAE_SCALE)
        return torch.einsum("ck,bkhw->bchw", LATENT_BASIS.to(rgb.device), pooled)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        # latent: [1, 16, h, w] -> [1, 3, 8h, 8w] in [0, 1]
        rgb = torch.einsum("ck,bchw->bkhw", LATENT_BASIS.to(latent.device), latent.float())
        rgb = F.interpolate(rgb, scale_factor=VAE_SCALE, mode="bilinear", align_corners=False)
        return ((rgb + 1) / 2).clamp(0, 1)


class DiffusersVAE:
    """A diffusers ``AutoencoderKL`` folder: computed by ditrun's own forward (``model.autoencoder``) where it
    describes one, as FLUX.1's and the editor's do; otherwise by diffusers (the ``vae`` extra:
    ``pip install ditrun[vae]``)."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype):
        config, self.dtype = autoencoder.read_config(path), dtype
        if autoencoder.supports(config):
            self.vae = autoencoder.load(path, config, device, dtype)
            self._encode = self.vae.encode_mode
            self._decode = self.vae.decode
        else:
            self.vae = _diffusers_autoencoder(path, device, dtype)
            self._encode = lambda x: self.vae.encode(x).latent_dist.mode()
            self._decode = lambda z: self.vae.decode(z).sample
        self.scale = config.get("scaling_factor", 0.18215)  # diffusers' default for a config without one
        self.shift = config.get("shift_factor") or 0.0

    @torch.no_grad()
    def encode(self, rgb: torch.Tensor) -> torch.Tensor:
        return (self._encode((rgb * 2 - 1).to(self.dtype)).float() - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        x = (latent / self.scale + self.shift).to(self.dtype)
        return ((self._decode(x).float() + 1) / 2).clamp(0, 1)


def _diffusers_autoencoder(path: str, device: torch.device, dtype: torch.dtype):
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        raise RuntimeError("workload.vae_path needs diffusers: pip install 'ditrun[vae]'.")
    # low_cpu_mem_usage off: that path wants accelerate and says so at every load; the weights are small.
    return (
        AutoencoderKL.from_pretrained(path, use_safetensors=True, low_cpu_mem_usage=False, torch_dtype=dtype)
        .to(device)
        .eval()
    )


def make_latent_codec(vae_path: Optional[str], device: torch.device, dtype: torch.dtype):
    return LinearLatentMap() if vae_path is None else DiffusersVAE(vae_path, device, dtype)


def pack(latent: torch.Tensor) -> torch.Tensor:
    """2x2 patches to tokens. latent: [B, 16, h, w] -> [B, (h/2)(w/2), 64]."""
    b, c, h, w = latent.shape
    x = latent.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``pack``. tokens: [B, (h/2)(w/2), 64] -> [B, 16, h, w]."""
    b, _, cp = tokens.shape
    c = cp // 4
    x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def token_ids(h: int, w: int, frame: int, device=None) -> torch.Tensor:
    """Position ids of packed tokens: (frame, row, column). -> [(h/2)(w/2), 3]."""
    rows = torch.arange(h // 2, device=device).repeat_interleave(w // 2)
    cols = torch.arange(w // 2, device=device).repeat(h // 2)
    return torch.stack([torch.full_like(rows, frame), rows, cols], dim=1).float()
