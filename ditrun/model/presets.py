"""Named model geometries and the resolution of ``model.*`` config keys into one ``DiTGeometry``."""

from __future__ import annotations

import dataclasses

from ditrun.model.dit import DiTGeometry
from ditrun.errors import UserError

PRESETS: dict[str, DiTGeometry] = {
    # CI: every code path in well under a second per step on one CPU core.
    "tiny": DiTGeometry(
        num_layers=2, num_single_layers=2, num_attention_heads=4, attention_head_dim=32,
        joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(8, 12, 12),
    ),
    # A CPU demo: about a second per CFG step at 256x256 and several at 512x512 on 2 cores.
    "small": DiTGeometry(
        num_layers=4, num_single_layers=8, num_attention_heads=8, attention_head_dim=64,
        joint_attention_dim=512, pooled_projection_dim=256, guidance_embeds=True, axes_dims_rope=(16, 24, 24),
    ),
    # FLUX.1-dev / FLUX.1-Kontext-dev (12B).
    "flux-dev": DiTGeometry(
        num_layers=19, num_single_layers=38, num_attention_heads=24, attention_head_dim=128,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    ),
}

VARIANTS = {
    "flux": dict(mlp="gelu", attention_gate=False, modulation_norm="layer"),
    # The block layout published for Krea 3.
    "krea3": dict(mlp="swiglu", attention_gate=True, modulation_norm="rms"),
}

_OVERRIDABLE = (
    "num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
    "joint_attention_dim", "pooled_projection_dim", "guidance_embeds",
)


def geometry_from_config(model_cfg) -> DiTGeometry:
    """The preset named by ``model.preset`` with every ``model.*`` geometry key that is set applied."""
    if model_cfg.preset not in PRESETS:
        raise UserError(f"model.preset={model_cfg.preset!r} is unknown; allowed: {', '.join(PRESETS)}.")
    overrides = {k: getattr(model_cfg, k) for k in _OVERRIDABLE if getattr(model_cfg, k) is not None}
    if model_cfg.variant is not None:
        if model_cfg.variant not in VARIANTS:
            raise UserError(f"model.variant={model_cfg.variant!r} is unknown; allowed: {', '.join(VARIANTS)}.")
        overrides.update(VARIANTS[model_cfg.variant])
    return dataclasses.replace(PRESETS[model_cfg.preset], **overrides)
