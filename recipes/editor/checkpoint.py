"""A phase's training state in ``--checkpoint-dir``, written atomically: ``<phase>.pt`` holds the model, the
optimizer, the EMA (DiT), the step (the learning-rate schedule is a function of it), the state of every random
generator (the data position among them) and the settings it was made with. ``pool.pt`` keeps the DiT's encoded
training pool for the commands that resume the training, under a fingerprint of everything it was made from.

A file is written under a temporary name in the same folder, flushed to disk, then renamed over the last one, so a
crash at any moment leaves either the previous checkpoint or the new one, whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Callable, Optional

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


def fingerprint(*parts) -> str:
    """A sha256 of ``parts``: tensors by their dtype, shape and bytes, dicts by their items, anything else by its
    repr."""
    digest = hashlib.sha256()

    def add(part) -> None:
        if isinstance(part, torch.Tensor):
            tensor = part.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
        elif isinstance(part, dict):
            for key, value in part.items():
                add(key)
                add(value)
        else:
            digest.update(repr(part).encode())

    for part in parts:
        add(part)
    return digest.hexdigest()


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
        self._write(phase, {**state, "config": dataclasses.asdict(self.cfg)})

    def _write(self, name: str, value: dict) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(name)
        partial = final.with_name(f".{final.name}.{os.getpid()}.partial")
        torch.save(value, partial)
        _fsync(partial)
        os.replace(partial, final)
        _fsync(self.folder)

    def cached(self, name: str, key: str, make: Callable[[], dict]) -> tuple[dict, bool]:
        """``make()``'s tensors, read from ``<name>.pt`` where a command of this training saved them under the same
        ``key``; else made, and saved there for the next (no folder: made, kept nowhere). -> (tensors, read)"""
        if self.folder is not None and self.path(name).is_file():
            saved = torch.load(self.path(name), map_location="cpu", weights_only=True)
            if saved.get("key") == key:
                return saved["value"], True
        value = make()
        self._write(name, {"key": key, "value": value})
        return value, False

    def load(self, phase: str) -> Optional[dict]:
        """The phase's last state, or None when there is none (or no folder)."""
        if self.folder is None or not self.path(phase).is_file():
            return None
        return torch.load(self.path(phase), map_location="cpu", weights_only=True)
