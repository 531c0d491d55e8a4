"""ditrun's own forward of a diffusers ``AutoencoderKL`` folder (FLUX.1's VAE and ditrun's editor's): the same
modules under the same parameter names, so the folder's weights load as they are, without importing diffusers
(whose import takes seconds: it pulls in torch._dynamo). ``tests/test_diffusers_parity.py`` holds it equal to
diffusers' ``AutoencoderKL`` on the same folder.

The layout: the encoder's ``conv_in``, one ``DownEncoderBlock2D`` per width (``layers_per_block`` ResNet blocks, then
a stride-2 convolution after a (0, 1, 0, 1) zero pad, except in the last), a middle block (ResNet, optional
one-head self-attention, ResNet), GroupNorm, SiLU and ``conv_out`` to the posterior's mean and log-variance; the
decoder mirrors it with ``layers_per_block + 1`` ResNet blocks per width and nearest 2x upsampling then a
convolution. Every GroupNorm has eps 1e-6. A folder of another kind (other block types or activation) is not this
module's: ``supports`` says so and the caller loads it with diffusers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ditrun.model.load import load_pretrained_weights

EPS = 1e-6


def supports(config: dict) -> bool:
    """Whether ``config`` (a ``vae/config.json``) describes an autoencoder this module computes exactly."""
    return (
        config.get("_class_name") == "AutoencoderKL"
        and set(config.get("down_block_types", ())) == {"DownEncoderBlock2D"}
        and set(config.get("up_block_types", ())) == {"UpDecoderBlock2D"}
        and config.get("act_fn", "silu") == "silu"
    )


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


class ResnetBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels_in, eps=EPS)
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, channels_out, eps=EPS)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(channels_in, channels_out, 1) if channels_in != channels_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class SelfAttention(nn.Module):
    """One head over every position, after a GroupNorm, added to its input."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=EPS)
        self.to_q, self.to_k, self.to_v = (nn.Linear(channels, channels) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).view(b, c, h * w).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(tokens)[:, None] for proj in (self.to_q, self.to_k, self.to_v))
        out = self.to_out[0](F.scaled_dot_product_attention(q, k, v)[:, 0])
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups) for _ in range(2)])
        self.attentions = nn.ModuleList([SelfAttention(channels, groups)] if attention else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        for attention in self.attentions:
            x = attention(x)
        return self.resnets[1](x)


class Resample(nn.Module):
    """The 3x3 convolution of a down (stride 2, after padding right and bottom) or up (after nearest 2x) step."""

    def __init__(self, channels: int, down: bool):
        super().__init__()
        self.down = down
        self.conv = nn.Conv2d(channels, channels, 3, stride=2 if down else 1, padding=0 if down else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.down:
            return self.conv(F.pad(x, (0, 1, 0, 1)))
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Stage(nn.Module):
    """A Down/UpEncoderBlock2D: ResNet blocks, then the resampling step unless it is the last stage."""

    def __init__(self, channels_in: int, channels_out: int, layers: int, groups: int, down: bool, resample: bool):
        super().__init__()
        widths = [channels_in] + [channels_out] * layers
        self.resnets = nn.ModuleList([ResnetBlock(a, b, groups) for a, b in zip(widths, widths[1:])])
        self.resampler = "downsamplers" if down else "upsamplers"  # diffusers' name, so that the weights load
        setattr(self, self.resampler, nn.ModuleList([Resample(channels_out, down)] if resample else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.resnets:
            x = block(x)
        for step in getattr(self, self.resampler):
            x = step(x)
        return x


class Coder(nn.Module):
    """The encoder (``down``) or the decoder: conv_in, the stages, the middle block, the output head."""

    def __init__(self, config: dict, down: bool):
        super().__init__()
        widths, groups = list(config["block_out_channels"]), config["norm_num_groups"]
        latent = config["latent_channels"]
        layers = config["layers_per_block"] + (0 if down else 1)
        attention = config.get("mid_block_add_attention", True)
        order = widths if down else widths[::-1]
        self.conv_in = nn.Conv2d(config["in_channels"] if down else latent, order[0], 3, padding=1)
        stages = [
            Stage(order[max(i - 1, 0)], order[i], layers, groups, down, resample=i < len(order) - 1)
            for i in range(len(order))
        ]
        self.stage_list = "down_blocks" if down else "up_blocks"
        setattr(self, self.stage_list, nn.ModuleList(stages))
        self.mid_block = MidBlock(widths[-1], groups, attention)
        self.conv_norm_out = nn.GroupNorm(groups, order[-1], eps=EPS)
        self.conv_out = nn.Conv2d(order[-1], 2 * latent if down else config["out_channels"], 3, padding=1)
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        if not self.down:
            x = self.mid_block(x)
        for stage in getattr(self, self.stage_list):
            x = stage(x)
        if self.down:
            x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class AutoencoderKL(nn.Module):
    """Encode to the posterior's mode, decode a latent; pixels in [-1, 1], latents before Flux's scale and shift."""

    def __init__(self, config: dict):
        super().__init__()
        latent = config["latent_channels"]
        self.encoder, self.decoder = Coder(config, down=True), Coder(config, down=False)
        self.quant_conv = nn.Conv2d(2 * latent, 2 * latent, 1) if config.get("use_quant_conv", True) else None
        self.post_quant_conv = nn.Conv2d(latent, latent, 1) if config.get("use_post_quant_conv", True) else None

    def encode_mode(self, x: torch.Tensor) -> torch.Tensor:
        moments = self.encoder(x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return moments.chunk(2, dim=1)[0]

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)


def load(path: str | Path, config: dict, device: torch.device, dtype: torch.dtype) -> AutoencoderKL:
    """The autoencoder of the folder ``path`` (its ``config`` from ``read_config``), its weights read as a DiT's are
    (single or sharded safetensors, every name and shape checked: ``model.load``)."""
    with torch.device("meta"):
        model = AutoencoderKL(config)
    load_pretrained_weights(model, path, dtype, device)
    return model.eval().requires_grad_(False)
