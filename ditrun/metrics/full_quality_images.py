"""The BF16 reference images SSIM compares against, computed once and cached on disk.

The reference of an edit is what the full-quality configuration makes of it (``full_quality``): layout
``single``, every component ``bf16`` (no quantization), no cache, no transport, at the reference's steps and
true CFG, on the same kind of device, in the reference dtype (``metrics.full_quality_dtype``, by default the run's
own compute dtype). It is made twice, by two separate denoising runs: the second gives ``ssim_rerun``.

Both images are cached as PNGs under a key of everything that decides them: the model
geometry and weights, the edit's image, prompt and seed, the steps, output and reference sizes,
both guidance settings (true CFG and the distilled value), the
VAE, the dtype and the device type. Any run of any layout, precision or transport with the
same key reuses them, so a sweep pays for its references once.

A cache is shared, long-lived and easy to damage by hand, so an entry is trusted only after a
check against what it says it is (``ReferenceCache``), and the measurement checks the rest: an
edit more similar to the reference than the BF16 rerun is, by more than nondeterminism allows,
has a broken reference (``BrokenReference``), never a good score.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ditrun.devices import dtype_name
from ditrun.metrics import full_quality
from ditrun.metrics.quality import QualityGateError
from ditrun.model.folders import vae_folder
from ditrun.model.latents import VAE_SCALE, make_latent_codec, unpack
from ditrun.model.sampler import denoise, sequential_cfg_velocity
from ditrun.results.files import fsync_folder, is_node_fault, save_png, to_rgb8, write_file
from ditrun.user_cache import user_cache_dir
from ditrun.workload.edit import Edit
from ditrun.workload.images import is_package_picture
from ditrun.workload.inputs import edit_inputs

# Bump when the sampler or model changes what a reference image of the same key is.
REFERENCE_FORMAT = 2
IMAGE_FILES = ("reference.png", "rerun.png")
KEY_FILE = "key.json"
# A run's SSIM can exceed the rerun's only by the rerun's own nondeterministic drift (two BF16 runs: 1.0 on a CPU
# and, measured, on an H200); beyond one percentage point the rerun is not a rerun of this reference.
BROKEN_REFERENCE_PCT = 101.0


@dataclass
class Reference:
    """The two BF16 runs of one edit, as [H, W, 3] uint8 images."""

    image: np.ndarray
    rerun: np.ndarray


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


def sampling(workload) -> dict:
    """The sampling settings a picture depends on: steps, and true CFG (at or below 1 one branch, whatever the
    value)."""
    return {
        "steps": workload.steps,
        "true_cfg_scale": workload.true_cfg_scale if workload.true_cfg_scale > 1 else "off",
    }


def reference_key(cfg, geometry, edit: Edit, dtype: torch.dtype, device_type: str) -> tuple[str, dict]:
    """(hex key, the JSON-able description it hashes) of one edit's reference."""
    workload = full_quality.full_quality_workload(cfg)
    image = edit.image if is_package_picture(edit.image) else _file_fingerprint(edit.image)
    description = {
        "format": REFERENCE_FORMAT,
        "geometry": dataclasses.asdict(geometry),
        "weights": _file_fingerprint(cfg.model.path) if cfg.model.path else {"seed": cfg.model.weights_seed},
        "edit": {
            "image": image,
            "prompt": edit.prompt,
            "prompt_embeds": _file_fingerprint(edit.prompt_embeds),
            "seed": edit.seed,
            "width": edit.width,
            "height": edit.height,
            "ref_width": edit.ref_width,
            "ref_height": edit.ref_height,
        },
        **sampling(workload),
        "guidance_scale": workload.guidance_scale if geometry.guidance_embeds else None,
        # The noise convention is diffusers'.
        "noise": "diffusers: [1, 16, h, w] in the compute dtype from a CPU generator, packed",
        "text_len": workload.text_len,
        "vae": _file_fingerprint(workload.vae_path),
        "dtype": dtype_name(dtype),
        "device": device_type,
    }
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32], description


class BrokenReference(QualityGateError):
    """A cached reference that only the measurement can tell is not this edit's: the run's image is more similar
    to the first BF16 run than the second BF16 run is, beyond what nondeterminism allows."""


class ReferenceCache:
    """``<root>/<key>/{reference.png, rerun.png, key.json}``; entries appear atomically (one rename).

    ``key.json`` says what the entry is: its key, the images' size and a SHA-256 of each image's pixels, and the
    description the key hashes. An entry is checked whenever it is read; one that does not match (another key,
    another size, other pixels, a file that is missing, truncated or not a PNG) is discarded with a one-line
    warning naming the file, and the caller makes it again.
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.unwritable = False  # the disk refused an entry (``save``): this run keeps its references in memory

    def load(self, key: str, size: tuple[int, int]) -> Optional[Reference]:
        """The entry of ``key`` if it holds two [height, width] = ``size`` images as written, else None."""
        entry = self.root / key
        if not entry.exists():
            return None
        try:
            return _checked_entry(entry, key, size)
        except BrokenEntry as err:
            print(
                f"ditrun: warning: reference cache entry {err.path} {err.reason}; discarded, it is made again",
                file=sys.stderr,
                flush=True,
            )
            self.discard(key)
            return None

    def save(self, key: str, reference: Reference, description: dict) -> None:
        """Store an entry; a cache the disk refuses mid-run (full, no longer writable) is one warning, and the run
        goes on without storing (its references stay in memory)."""
        if self.unwritable:
            return
        try:
            self._save(key, reference, description)
        except OSError as err:
            if not is_node_fault(err):
                raise
            self.unwritable = True
            print(
                f"ditrun: warning: the reference cache {self.root} cannot be written ({err.strerror or err}); this run "
                "goes on without storing its references, a later run makes them again (free space there, or set "
                "metrics.full_quality_dir to a folder with room)",
                file=sys.stderr,
                flush=True,
            )

    def _save(self, key: str, reference: Reference, description: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        height, width = reference.image.shape[:2]
        sidecar = {"key": key, "width": width, "height": height, "pixels_sha256": {}, "description": description}
        try:
            for name, pixels in zip(IMAGE_FILES, (reference.image, reference.rerun)):
                save_png(pixels, tmp / name)
                sidecar["pixels_sha256"][name] = pixel_checksum(pixels)
            # Each file and the folder are flushed (write_file): the rename below must never publish a name whose
            # data is not on disk yet.
            write_file(tmp / KEY_FILE, json.dumps(sidecar, indent=2, default=str).encode())
            os.rename(tmp, self.root / key)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, OSError) and (self.root / key).is_dir():
                return  # another process stored the same key first; its images are as good
            raise
        fsync_folder(self.root)

    def discard(self, key: str) -> None:
        """Take the entry out of use at once (a rename), then delete it. An entry that another process replaced
        in between goes too: that costs a recomputation, never a run its references (``References`` keep theirs)."""
        aside = self.root / f".{key}.discarded.{os.getpid()}"
        try:
            os.rename(self.root / key, aside)
        except OSError:  # already gone: another process discarded or replaced it
            return
        shutil.rmtree(aside, ignore_errors=True)


class BrokenEntry(Exception):
    """A cache entry that is not what its ``key.json`` says: ``path`` is the file that shows it."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


def pixel_checksum(pixels: np.ndarray) -> str:
    """SHA-256 of an [H, W, 3] uint8 image's shape and pixels."""
    digest = hashlib.sha256(f"{pixels.shape}".encode())
    digest.update(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
    return digest.hexdigest()


def _checked_entry(entry: Path, key: str, size: tuple[int, int]) -> Reference:
    sidecar = _read_sidecar(entry / KEY_FILE)
    if sidecar.get("key") != key:
        raise BrokenEntry(entry / KEY_FILE, f"names key {sidecar.get('key')!r}, not its folder's")
    checksums = sidecar.get("pixels_sha256")
    if not isinstance(checksums, dict):
        raise BrokenEntry(entry / KEY_FILE, "has no pixel checksums")
    images = [_checked_image(entry / name, size, checksums.get(name)) for name in IMAGE_FILES]
    return Reference(*images)


def _read_sidecar(path: Path) -> dict:
    try:
        sidecar = json.loads(path.read_text())
    except FileNotFoundError:
        raise BrokenEntry(path, "is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise BrokenEntry(path, "is unreadable or not JSON") from None
    if not isinstance(sidecar, dict):
        raise BrokenEntry(path, "is not a JSON object")
    return sidecar


def _checked_image(path: Path, size: tuple[int, int], checksum: Optional[str]) -> np.ndarray:
    """The [H, W, 3] pixels of ``path``, if they are ``size`` and match ``checksum``."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            if (image.height, image.width) != size:  # before decoding: a wrong header costs nothing
                raise BrokenEntry(path, f"is {image.width}x{image.height}, not the edit's {size[1]}x{size[0]}")
            pixels = np.asarray(image.convert("RGB"))
    except FileNotFoundError:
        raise BrokenEntry(path, "is missing") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        raise BrokenEntry(path, "is truncated or not a PNG") from None
    if pixel_checksum(pixels) != checksum:
        raise BrokenEntry(path, f"does not match the pixel checksum in its {KEY_FILE}")
    return pixels


class References:
    """The references of a run's edits, by edit id: read from the cache (and checked) or made, then kept."""

    def __init__(self, cache: ReferenceCache, keys: dict[str, str], descriptions: dict[str, dict], dtype: torch.dtype):
        self.cache, self.keys, self.descriptions, self.dtype = cache, keys, descriptions, dtype
        self._loaded: dict[str, Reference] = {}

    def _size(self, edit_id: str) -> tuple[int, int]:
        edit = self.descriptions[edit_id]["edit"]
        return edit["height"], edit["width"]

    def missing(self, edits: list[Edit]) -> list[Edit]:
        """Edits without a cached reference, or whose entry failed its check (and was discarded). The others are
        kept from here on: another run repairing the cache meanwhile cannot take them away."""
        missing = []
        for edit in edits:
            reference = self.cache.load(self.keys[edit.id], self._size(edit.id))
            if reference is None:
                missing.append(edit)
            else:
                self._loaded[edit.id] = reference
        return missing

    def get(self, edit_id: str) -> Optional[Reference]:
        if edit_id not in self._loaded and edit_id in self.keys:
            reference = self.cache.load(self.keys[edit_id], self._size(edit_id))
            if reference is not None:
                self._loaded[edit_id] = reference
        return self._loaded.get(edit_id)

    def check_measured(self, edit_id: str, fields: dict) -> None:
        """Raise ``BrokenReference`` (and discard the entry) when an edit's SSIM is above its rerun's by more than
        nondeterminism explains: a pixel checksum vouches that the files are what was written, not that the two
        images are two runs of this edit."""
        pct = fields.get("ssim_pct_of_rerun")
        if pct is None or pct <= BROKEN_REFERENCE_PCT:
            return
        entry = self.cache.root / self.keys[edit_id]
        self.cache.discard(self.keys[edit_id])
        self._loaded.pop(edit_id, None)
        raise BrokenReference(
            f"edit {edit_id!r} scores {pct:.2f}% of its BF16 rerun's SSIM, above the {BROKEN_REFERENCE_PCT:g}% that "
            f"two BF16 runs allow, so its cached reference {entry} is broken; the entry was discarded: rerun the same "
            "command to make it again and resume."
        )

    def make_missing(
        self,
        edits: list[Edit],
        cfg,
        geometry,
        device: torch.device,
        build_model: Callable[[torch.dtype], torch.nn.Module],
        progress=None,
        announce: bool = True,
        stop_point: Optional[Callable[[], None]] = None,
    ) -> None:
        """Make the references ``edits`` lack, with a model built only if one is missing (and freed after);
        ``stop_point`` is called after every denoising step (it raises to stop the pass there)."""
        missing = self.missing(edits)
        if announce and not missing:
            print(f"ditrun: the references of all {len(edits)} edits come from {self.cache.root}", flush=True)
        if not missing:
            return
        if announce:
            print(
                f"ditrun: making the references of {len(missing)} edits (full quality: {dtype_name(self.dtype)}, "
                f"no quantization, no cache, layout single; 2 runs each), cached in {self.cache.root}",
                flush=True,
            )
        model = build_model(self.dtype)
        codec = make_latent_codec(vae_folder(cfg.model.path, cfg.workload.vae_path), device, self.dtype)
        workload = full_quality.full_quality_workload(cfg)
        for edit in missing:
            # Two separate runs: on GPUs they differ.
            runs = [
                _render_with_bar(
                    model, codec, geometry, edit, workload, self.dtype, device, progress, label, stop_point
                )
                for label in ("reference", "rerun")
            ]
            self._loaded[edit.id] = Reference(*runs)
            self.cache.save(self.keys[edit.id], self._loaded[edit.id], self.descriptions[edit.id])
            if progress is not None:
                progress.advance()
        del model, codec
        if device.type == "cuda":
            torch.cuda.empty_cache()


def reference_set(cfg, geometry, edits: list[Edit], dtype: torch.dtype, device_type: str) -> References:
    """The keys of every edit's reference (cheap: nothing is loaded or made)."""
    cache = ReferenceCache(
        Path(cfg.metrics.full_quality_dir) if cfg.metrics.full_quality_dir else user_cache_dir() / "references"
    )
    keys, descriptions = {}, {}
    for edit in edits:
        keys[edit.id], descriptions[edit.id] = reference_key(cfg, geometry, edit, dtype, device_type)
    return References(cache, keys, descriptions, dtype)


def _render_with_bar(
    model,
    codec,
    geometry,
    edit: Edit,
    workload_cfg,
    dtype,
    device,
    progress,
    label: str,
    stop_point: Optional[Callable[[], None]] = None,
):
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


def render_single(
    model,
    codec,
    geometry,
    edit: Edit,
    workload_cfg,
    dtype: torch.dtype,
    device: torch.device,
    on_step: Optional[Callable[[int], None]] = None,
) -> np.ndarray:
    """One edit on one process, both CFG branches one after the other -> [H, W, 3] uint8."""
    inputs = edit_inputs(edit, codec, geometry, workload_cfg, device, dtype)
    guidance = workload_cfg.guidance_scale if geometry.guidance_embeds else None
    velocity = sequential_cfg_velocity(model, inputs, workload_cfg.true_cfg_scale, guidance, dtype)
    with torch.inference_mode():
        latents = denoise(velocity, inputs.noise, workload_cfg.steps, on_step=on_step)
        image = codec.decode(unpack(latents, edit.height // VAE_SCALE, edit.width // VAE_SCALE))
    return to_rgb8(image)
