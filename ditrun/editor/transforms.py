"""The editor's instructions: each a known function of the input picture, with several phrasings.

An edit's correct output is ``apply(name, picture)``: the transform applied to the reference at
the output's size. Every transform maps RGB in [0, 1] to RGB in [0, 1] and keeps the picture's size,
so the output of an edit has the reference's geometry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ditrun.registry import Registry

# images: [B, 3, H, W] in [0, 1] -> [B, 3, H, W] in [0, 1]
Transform = Callable[[torch.Tensor], torch.Tensor]

# ITU-R BT.601 luma weights, as PIL's convert("L").
LUMA = (0.299, 0.587, 0.114)
# The common sepia matrix (rows: output R, G, B).
SEPIA = ((0.393, 0.769, 0.189), (0.349, 0.686, 0.168), (0.272, 0.534, 0.131))
POSTER_LEVELS = 2
# Blur's Gaussian sigma as a fraction of the picture's shorter side (2 pixels at 256).
BLUR_SIGMA = 1 / 128


@dataclass(frozen=True)
class Edit:
    """One instruction: what it does, and the prompts that ask for it (the first is the canonical one)."""

    transform: Transform
    phrasings: tuple[str, ...]


def _mix(images: torch.Tensor, matrix) -> torch.Tensor:
    weights = torch.tensor(matrix, dtype=images.dtype, device=images.device)
    return torch.einsum("oc,bchw->bohw", weights, images).clamp(0, 1)


def mirror(images: torch.Tensor) -> torch.Tensor:
    return images.flip(-1)


def upside_down(images: torch.Tensor) -> torch.Tensor:
    return images.flip(-2)


def grayscale(images: torch.Tensor) -> torch.Tensor:
    return _mix(images, (LUMA,) * 3)


def invert(images: torch.Tensor) -> torch.Tensor:
    return 1 - images


def red_blue_swap(images: torch.Tensor) -> torch.Tensor:
    """ "Make it blue": the red and blue channels swapped, so warm colours turn blue."""
    return images.flip(-3)


def sepia(images: torch.Tensor) -> torch.Tensor:
    return _mix(images, SEPIA)


def posterize(images: torch.Tensor, levels: int = POSTER_LEVELS) -> torch.Tensor:
    """Each channel rounded to ``levels`` evenly spaced values (0 and 1 among them)."""
    steps = levels - 1
    return torch.round(images * steps) / steps


def blur(images: torch.Tensor) -> torch.Tensor:
    """A Gaussian blur of sigma = 1/128 of the shorter side, edges reflected."""
    sigma = BLUR_SIGMA * min(images.shape[-2:])
    radius = max(1, math.ceil(3 * sigma))
    x = torch.arange(-radius, radius + 1, dtype=images.dtype, device=images.device)
    kernel = torch.exp(-0.5 * (x / sigma) ** 2)
    kernel = (kernel / kernel.sum()).repeat(3, 1)[:, None]  # [3, 1, k]
    out = F.pad(images, (radius, radius, 0, 0), mode="reflect")
    out = F.conv2d(out, kernel[:, :, None, :], groups=3)
    out = F.pad(out, (0, 0, radius, radius), mode="reflect")
    return F.conv2d(out, kernel[:, :, :, None], groups=3)


def brighten(images: torch.Tensor) -> torch.Tensor:
    """Gamma 1/2: dark tones lifted most, black and white kept."""
    return images.clamp(0, 1).sqrt()


def pixelate(images: torch.Tensor) -> torch.Tensor:
    """Blocks of 1/16 of the shorter side (16 pixels at 256) filled with their mean colour."""
    block = max(1, min(images.shape[-2:]) // 16)
    height, width = images.shape[-2:]
    pooled = F.avg_pool2d(images, block, ceil_mode=True)
    return F.interpolate(pooled, scale_factor=block, mode="nearest")[..., :height, :width]


EDITS: Registry[Edit] = Registry("edit target")
EDITS.register(
    "mirror", Edit(mirror, ("mirror the picture", "flip it left to right", "make a mirror image", "flip horizontally"))
)
EDITS.register(
    "upside_down",
    Edit(
        upside_down,
        ("turn it upside down", "flip it vertically", "flip the picture upside down", "make it upside down"),
    ),
)
EDITS.register(
    "grayscale",
    Edit(grayscale, ("make it black and white", "remove the colour", "convert to grayscale", "make it monochrome")),
)
EDITS.register(
    "invert",
    Edit(invert, ("invert the colours", "make a photographic negative", "invert it", "turn it into a negative")),
)
EDITS.register(
    "blue",
    Edit(red_blue_swap, ("make it blue", "swap red and blue", "turn the warm colours blue", "give it a blue look")),
)
EDITS.register(
    "sepia",
    Edit(
        sepia,
        (
            "give it a sepia tone",
            "make it look like an old photograph",
            "apply a sepia filter",
            "make it vintage brown",
        ),
    ),
)
EDITS.register(
    "posterize",
    Edit(
        posterize, ("posterize it", "reduce it to a few colours", "make it look like a poster", "flatten the colours")
    ),
)
EDITS.register("brighten", Edit(brighten, ("make it brighter", "brighten it", "lift the shadows", "make it lighter")))
EDITS.register(
    "pixelate",
    Edit(pixelate, ("pixelate it", "make it blocky", "turn it into big pixels", "make it look like a mosaic")),
)
EDITS.register("blur", Edit(blur, ("blur it", "make it blurry", "soften the picture", "put it out of focus")))


def apply(name: str, images: torch.Tensor) -> torch.Tensor:
    """The correct output of edit ``name`` for ``images`` ([B, 3, H, W] in [0, 1])."""
    return EDITS.get(name, "target").transform(images)


def prompts() -> list[str]:
    """Every phrasing of every edit, in registry order."""
    return [p for _, edit in EDITS.items() for p in edit.phrasings]
