"""The BF16 reference images SSIM compares against, computed once and cached on disk.

The reference of an edit is what the plain model makes of it: layout ``single``, every
component ``bf16`` (no quantization), no transport, on the same kind of device, in the
reference dtype (``metrics.reference_dtype``, by default the run's own compute dtype). It is
made twice, by two separate denoising runs: the second gives ``ssim_rerun``.

Both images are cached as PNGs under a key of everything that decides them: the model
geometry and weights, the edit's image, prompt and seed, the steps, output and reference sizes,
both guidance settings (true CFG and the distilled value), the
VAE, the dtype and the device type. Any run of any layout, precision or transport with the
same key reuses them, so a sweep pays for its references once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ditrun.metrics.results import save_png, to_rgb8
from ditrun.model.latents import VAE_SCALE, make_latent_codec, unpack
from ditrun.model.sampler import denoise, sequential_cfg_velocity
from ditrun.model.text import vae_folder
from ditrun.workload import Edit, edit_inputs

# Bump when the sampler or model changes what a reference image of the same key is.
REFERENCE_FORMAT = 2
REFERENCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Reference:
    """The two BF16 runs of one edit, as [H, W, 3] uint8 images."""

    image: np.ndarray
    rerun: np.ndarray


def dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in REFERENCE_DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ditrun" / "references"


def _file_fingerprint(path: Optional[str]) -> Optional[list]:
    """Content hash of a small input file (image, embeddings); size and mtime of a folder's files."""
    if not path:
        return None
    p = Path(path)
    if p.is_file():
        return [p.name, hashlib.sha256(p.read_bytes()).hexdigest()]
    if p.is_dir():
        return sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in p.rglob("*") if f.is_file())
    return [str(path), "missing"]


def reference_key(cfg, geometry, edit: Edit, dtype: torch.dtype, device_type: str) -> tuple[str, dict]:
    """(hex key, the JSON-able description it hashes) of one edit's reference."""
    workload = cfg.workload
    image = edit.image if edit.image.startswith("skimage:") else _file_fingerprint(edit.image)
    description = {
        "format": REFERENCE_FORMAT,
        "geometry": dataclasses.asdict(geometry),
        "weights": _file_fingerprint(cfg.model.path) if cfg.model.path else {"seed": cfg.model.weights_seed},
        "edit": {"image": image, "prompt": edit.prompt, "prompt_embeds": _file_fingerprint(edit.prompt_embeds),
                 "seed": edit.seed, "width": edit.width, "height": edit.height,
                 "ref_width": edit.ref_width, "ref_height": edit.ref_height},
        "steps": workload.steps,
        # true CFG at or below 1 is one branch, whatever the value; the noise convention is diffusers'.
        "true_cfg_scale": workload.true_cfg_scale if workload.true_cfg_scale > 1 else "off",
        "guidance_scale": workload.guidance_scale if geometry.guidance_embeds else None,
        "noise": "diffusers: [1, 16, h, w] in the compute dtype from a CPU generator, packed",
        "text_len": workload.text_len,
        "vae": _file_fingerprint(workload.vae_path),
        "dtype": dtype_name(dtype),
        "device": device_type,
    }
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32], description


class ReferenceCache:
    """``<root>/<key>/{reference.png, rerun.png, key.json}``; entries appear atomically (one rename)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def load(self, key: str) -> Optional[Reference]:
        from skimage import io

        entry = self.root / key
        if not (entry / "rerun.png").is_file():
            return None
        return Reference(io.imread(entry / "reference.png")[..., :3], io.imread(entry / "rerun.png")[..., :3])

    def save(self, key: str, reference: Reference, description: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        save_png(reference.image, tmp / "reference.png")
        save_png(reference.rerun, tmp / "rerun.png")
        (tmp / "key.json").write_text(json.dumps(description, indent=2, default=str))
        try:
            os.rename(tmp, self.root / key)
        except OSError:  # another process stored the same key first; its images are as good
            shutil.rmtree(tmp, ignore_errors=True)


class References:
    """The references of a run's edits, by edit id; read from the cache when first asked for."""

    def __init__(self, cache: ReferenceCache, keys: dict[str, str], descriptions: dict[str, dict], dtype: torch.dtype):
        self.cache, self.keys, self.descriptions, self.dtype = cache, keys, descriptions, dtype
        self._loaded: dict[str, Reference] = {}

    def missing(self, edits: list[Edit]) -> list[Edit]:
        return [e for e in edits if not (self.cache.root / self.keys[e.id] / "rerun.png").is_file()]

    def get(self, edit_id: str) -> Optional[Reference]:
        if edit_id not in self._loaded and edit_id in self.keys:
            reference = self.cache.load(self.keys[edit_id])
            if reference is not None:
                self._loaded[edit_id] = reference
        return self._loaded.get(edit_id)

    def make_missing(self, edits: list[Edit], cfg, geometry, device: torch.device,
                     build_model: Callable[[torch.dtype], torch.nn.Module], progress=None, announce: bool = True,
                     stop_point: Optional[Callable[[], None]] = None) -> None:
        """Make the references ``edits`` lack, with a model built only if one is missing (and freed after);
        ``stop_point`` is called after every denoising step (it raises to stop the pass there)."""
        missing = self.missing(edits)
        if announce and not missing:
            print(f"ditrun: the references of all {len(edits)} edits come from {self.cache.root}", flush=True)
        if not missing:
            return
        if announce:
            print(f"ditrun: making the references of {len(missing)} edits (precision bf16, layout single, "
                  f"{dtype_name(self.dtype)}; 2 runs each), cached in {self.cache.root}", flush=True)
        model = build_model(self.dtype)
        codec = make_latent_codec(vae_folder(cfg.model.path, cfg.workload.vae_path), device, self.dtype)
        for edit in missing:
            # Two separate runs: on GPUs they differ.
            runs = [_render_with_bar(model, codec, geometry, edit, cfg.workload, self.dtype, device, progress, label,
                                     stop_point) for label in ("reference", "rerun")]
            self.cache.save(self.keys[edit.id], Reference(*runs), self.descriptions[edit.id])
            if progress is not None:
                progress.advance()
        del model, codec
        if device.type == "cuda":
            torch.cuda.empty_cache()


def reference_set(cfg, geometry, edits: list[Edit], dtype: torch.dtype, device_type: str) -> References:
    """The keys of every edit's reference (cheap: nothing is loaded or made)."""
    cache = ReferenceCache(Path(cfg.metrics.reference_dir) if cfg.metrics.reference_dir else default_cache_dir())
    keys, descriptions = {}, {}
    for edit in edits:
        keys[edit.id], descriptions[edit.id] = reference_key(cfg, geometry, edit, dtype, device_type)
    return References(cache, keys, descriptions, dtype)


def _render_with_bar(model, codec, geometry, edit: Edit, workload_cfg, dtype, device, progress, label: str,
                     stop_point: Optional[Callable[[], None]] = None):
    bar = progress.edit(f"{label} {edit.id}", workload_cfg.steps) if progress is not None else None

    def on_step(_i: int) -> None:
        if bar is not None:
            bar.update(1)
        if stop_point is not None:
            stop_point()

    try:
        return render_single(model, codec, geometry, edit, workload_cfg, dtype, device, on_step)
    finally:
        if bar is not None:
            bar.close()


def render_single(model, codec, geometry, edit: Edit, workload_cfg, dtype: torch.dtype, device: torch.device,
                  on_step: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """One edit on one process, both CFG branches one after the other -> [H, W, 3] uint8."""
    inputs = edit_inputs(edit, codec, geometry, workload_cfg, device, dtype)
    guidance = workload_cfg.guidance_scale if geometry.guidance_embeds else None
    velocity = sequential_cfg_velocity(model, inputs, workload_cfg.true_cfg_scale, guidance, dtype)
    with torch.inference_mode():
        latents = denoise(velocity, inputs.noise, workload_cfg.steps, on_step=on_step)
        image = codec.decode(unpack(latents, edit.height // VAE_SCALE, edit.width // VAE_SCALE))
    return to_rgb8(image)
