"""The editor's instructions: each a known function of the input picture, with several phrasings.

An edit's correct output is ``apply(name, picture)``: the transform applied to the reference at
the output's size. Every transform maps RGB in [0, 1] to RGB in [0, 1] and keeps the picture's size,
so the output of an edit has the reference's geometry (a quarter turn of a non-square picture is
resized back to the picture's size).
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

# ITU-R BT.601 luma weights, as PIL's convert("L") and scikit-image's rgb2gray of old.
LUMA = (0.299, 0.587, 0.114)
# The common sepia matrix (rows: output R, G, B).
SEPIA = ((0.393, 0.769, 0.189), (0.349, 0.686, 0.168), (0.272, 0.534, 0.131))
POSTER_LEVELS = 4
# Blur's Gaussian sigma as a fraction of the picture's shorter side (2 pixels at 256).
BLUR_SIGMA = 1 / 128


@dataclass(frozen=True)
class Edit:
    """One instruction: what it does, and the prompts that ask for it (the first is the canonical one)."""

    transform: Transform
    phrasings: tuple[str, ...]


def _resize(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    if images.shape[-2:] == (height, width):
        return images
    return F.interpolate(images, size=(height, width), mode="bilinear", antialias=True, align_corners=False)


def _mix(images: torch.Tensor, matrix) -> torch.Tensor:
    weights = torch.tensor(matrix, dtype=images.dtype, device=images.device)
    return torch.einsum("oc,bchw->bohw", weights, images).clamp(0, 1)


def mirror(images: torch.Tensor) -> torch.Tensor:
    return images.flip(-1)


def upside_down(images: torch.Tensor) -> torch.Tensor:
    return images.flip(-2)


def quarter_turn(images: torch.Tensor) -> torch.Tensor:
    """A quarter turn counter-clockwise, resized back to the picture's size when it is not square."""
    height, width = images.shape[-2:]
    return _resize(torch.rot90(images, 1, dims=(-2, -1)), height, width)


def grayscale(images: torch.Tensor) -> torch.Tensor:
    return _mix(images, (LUMA,) * 3)


def invert(images: torch.Tensor) -> torch.Tensor:
    return 1 - images


def red_blue_swap(images: torch.Tensor) -> torch.Tensor:
    """"Make it blue": the red and blue channels swapped, so warm colours turn blue."""
    return images.flip(-3)


def sepia(images: torch.Tensor) -> torch.Tensor:
    return _mix(images, SEPIA)


def posterize(images: torch.Tensor) -> torch.Tensor:
    steps = POSTER_LEVELS - 1
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


def zoom(images: torch.Tensor) -> torch.Tensor:
    """The centre half of each side, enlarged back to the picture's size (2x zoom)."""
    height, width = images.shape[-2:]
    top, left = height // 4, width // 4
    return _resize(images[..., top:top + height // 2, left:left + width // 2], height, width)


EDITS: Registry[Edit] = Registry("edit target")
EDITS.register("mirror", Edit(mirror, (
    "mirror the picture", "flip it left to right", "make a mirror image", "flip horizontally")))
EDITS.register("upside_down", Edit(upside_down, (
    "turn it upside down", "flip it vertically", "flip the picture upside down", "make it upside down")))
EDITS.register("quarter_turn", Edit(quarter_turn, (
    "rotate it a quarter turn to the left", "rotate 90 degrees counterclockwise", "turn the picture on its side",
    "rotate left")))
EDITS.register("grayscale", Edit(grayscale, (
    "make it black and white", "remove the colour", "convert to grayscale", "make it monochrome")))
EDITS.register("invert", Edit(invert, (
    "invert the colours", "make a photographic negative", "invert it", "turn it into a negative")))
EDITS.register("blue", Edit(red_blue_swap, (
    "make it blue", "swap red and blue", "turn the warm colours blue", "give it a blue look")))
EDITS.register("sepia", Edit(sepia, (
    "give it a sepia tone", "make it look like an old photograph", "apply a sepia filter", "make it vintage brown")))
EDITS.register("posterize", Edit(posterize, (
    "posterize it", "reduce it to a few colours", "make it look like a poster", "flatten the colours")))
EDITS.register("blur", Edit(blur, (
    "blur it", "make it blurry", "soften the picture", "put it out of focus")))
EDITS.register("zoom", Edit(zoom, (
    "zoom into the centre", "zoom in two times", "crop to the middle and enlarge it", "enlarge the centre")))


def apply(name: str, images: torch.Tensor) -> torch.Tensor:
    """The correct output of edit ``name`` for ``images`` ([B, 3, H, W] in [0, 1])."""
    return EDITS.get(name, "target").transform(images)


def prompts() -> list[str]:
    """Every phrasing of every edit, in registry order."""
    return [p for _, edit in EDITS.items() for p in edit.phrasings]
