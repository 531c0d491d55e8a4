"""The Flux-style DiT, its presets, weight loading and the edit sampler."""

from ditrun.model.dit import DiTGeometry, FluxDiT
from ditrun.model.load import CheckpointError, from_pretrained, random_model, save_pretrained
from ditrun.model.presets import PRESETS

__all__ = ["DiTGeometry", "FluxDiT", "CheckpointError", "from_pretrained", "random_model", "save_pretrained", "PRESETS"]
