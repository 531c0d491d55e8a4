"""A phase's training state in ``--checkpoint-dir``, written atomically: ``<phase>.pt`` holds the model, the
optimizer, the EMA (DiT), the step (the learning-rate schedule is a function of it), the state of every random
generator (the data position among them) and the settings it was made with.

A file is written under a temporary name in the same folder, flushed to disk, then renamed over the last one, so a
crash at any moment leaves either the previous checkpoint or the new one, whole.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import torch

from recipes.editor.config import TrainConfig


def generator_states(generators: dict) -> dict:
    """Every generator the phase draws from, and torch's global ones (CPU, and CUDA where there is one)."""
    states = {name: gen.get_state() for name, gen in generators.items()}
    states["torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_generators(generators: dict, states: dict) -> None:
    for name, gen in generators.items():
        gen.set_state(states[name])
    torch.set_rng_state(states["torch"])
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda"])


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class Checkpoints:
    """``<phase>.pt`` files in one folder; ``folder`` None keeps nothing (a run that cannot be resumed)."""

    def __init__(self, folder: Optional[Path], cfg: TrainConfig):
        self.folder, self.cfg = folder, cfg

    def path(self, phase: str) -> Path:
        return self.folder / f"{phase}.pt"

    def save(self, phase: str, state: dict) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(phase)
        partial = final.with_name(f".{final.name}.{os.getpid()}.partial")
        torch.save({**state, "config": dataclasses.asdict(self.cfg)}, partial)
        _fsync(partial)
        os.replace(partial, final)
        _fsync(self.folder)

    def load(self, phase: str) -> Optional[dict]:
        """The phase's last state, or None when there is none (or no folder)."""
        if self.folder is None or not self.path(phase).is_file():
            return None
        return torch.load(self.path(phase), map_location="cpu", weights_only=True)
