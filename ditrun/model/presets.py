"""Named model geometries and the resolution of ``model.*`` config keys into one ``DiTGeometry``."""

from __future__ import annotations

import dataclasses

from ditrun.errors import UserError
from ditrun.model.dit import DiTGeometry

PRESETS: dict[str, DiTGeometry] = {
    # CI: every code path in well under a second per step on one CPU core.
    "tiny": DiTGeometry(
        num_layers=2,
        num_single_layers=2,
        num_attention_heads=4,
        attention_head_dim=32,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(8, 12, 12),
    ),
    # A CPU demo: about a second per CFG step at 256x256 and several at 512x512 on 2 cores.
    "small": DiTGeometry(
        num_layers=4,
        num_single_layers=8,
        num_attention_heads=8,
        attention_head_dim=64,
        joint_attention_dim=512,
        pooled_projection_dim=256,
        guidance_embeds=True,
        axes_dims_rope=(16, 24, 24),
    ),
    # ditrun's trained editor (docs/EDITOR.md): its text encoders give 64 channels per token and 64 pooled.
    "editor": DiTGeometry(
        num_layers=4,
        num_single_layers=8,
        num_attention_heads=4,
        attention_head_dim=32,
        joint_attention_dim=64,
        pooled_projection_dim=64,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    ),
    # FLUX.1-dev / FLUX.1-Kontext-dev (12B).
    "flux-dev": DiTGeometry(
        num_layers=19,
        num_single_layers=38,
        num_attention_heads=24,
        attention_head_dim=128,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
}

VARIANTS = {
    "flux": dict(mlp="gelu", attention_gate=False, modulation_norm="layer"),
    # The block layout published for Krea 3.
    "krea3": dict(mlp="swiglu", attention_gate=True, modulation_norm="rms"),
}

_OVERRIDABLE = (
    "num_layers",
    "num_single_layers",
    "num_attention_heads",
    "attention_head_dim",
    "joint_attention_dim",
    "pooled_projection_dim",
    "guidance_embeds",
)


def check_preset_name(preset: str) -> None:
    if preset not in PRESETS:
        raise UserError(f"model.preset={preset!r} is unknown; allowed: {', '.join(PRESETS)}.")


def geometry_from_config(model_cfg) -> DiTGeometry:
    """The preset named by ``model.preset`` with every ``model.*`` geometry key that is set applied."""
    check_preset_name(model_cfg.preset)
    overrides = {k: getattr(model_cfg, k) for k in _OVERRIDABLE if getattr(model_cfg, k) is not None}
    check_geometry_numbers(overrides, "model.")
    if not 0 <= model_cfg.weights_seed < 2**64:
        raise UserError(f"model.weights_seed={model_cfg.weights_seed} is not a seed; allowed: 0 to 2**64 - 1.")
    _check_head_dim(model_cfg.preset, overrides.get("attention_head_dim"))
    if model_cfg.variant is not None:
        if model_cfg.variant not in VARIANTS:
            raise UserError(f"model.variant={model_cfg.variant!r} is unknown; allowed: {', '.join(VARIANTS)}.")
        overrides.update(VARIANTS[model_cfg.variant])
    return dataclasses.replace(PRESETS[model_cfg.preset], **overrides)


# Geometry numbers that must be at least 1, and those that may be 0 (a model of one block kind only).
_AT_LEAST_ONE = ("num_attention_heads", "attention_head_dim", "joint_attention_dim", "pooled_projection_dim")
_BLOCK_COUNTS = ("num_layers", "num_single_layers")


def check_geometry_numbers(values: dict, where: str) -> None:
    """Sizes in ``values`` (config overrides, or a checkpoint's config.json) that no model can have;
    ``where`` prefixes the key in the message (``model.``, or the file)."""
    for key in _AT_LEAST_ONE:
        if key in values and not (isinstance(values[key], int) and values[key] >= 1):
            raise UserError(f"{where}{key}={values[key]!r} must be a positive integer.")
    for key in _BLOCK_COUNTS:
        if key in values and not (isinstance(values[key], int) and values[key] >= 0):
            raise UserError(f"{where}{key}={values[key]!r} must be 0 or more blocks.")
    if all(key in values for key in _BLOCK_COUNTS) and not values["num_layers"] + values["num_single_layers"]:
        raise UserError(f"{where}num_layers and {where}num_single_layers are both 0; a model needs a block.")


def _check_head_dim(preset: str, head_dim) -> None:
    """The rotary axes come with the preset and must fill each head exactly."""
    axes = PRESETS[preset].axes_dims_rope
    if head_dim is not None and head_dim != sum(axes):
        raise UserError(
            f"model.attention_head_dim={head_dim} does not fit preset {preset!r}, whose rotary axes "
            f"{axes} fill {sum(axes)} channels per head; leave it unset or choose another model preset."
        )
