"""Workloads: which edits to run, and turning one edit into model inputs.

An edit is a reference image + a prompt embedding + a seed + an output size. Edits come inline
from ``workload.edits`` or from a YAML/JSONL manifest (``workload.manifest``). Images are
``skimage:<name>`` (photographs shipped with scikit-image) or files; prompt embeddings come
from a safetensors file or, without one, a stand-in seeded by the prompt text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import yaml

from ditrun.errors import UserError
from ditrun.model.latents import VAE_SCALE, pack, token_ids
from ditrun.model.sampler import EditInputs

_EDIT_KEYS = ("id", "image", "prompt", "prompt_embeds", "seed", "width", "height")
# An edit id names its output files, so it must be a plain file stem: nothing that could climb
# out of the results directory, make a sub-folder or hide a file.
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class WorkloadError(UserError):
    """A workload the run cannot start with; the message names the edit."""


@dataclass(frozen=True)
class Edit:
    """One fully resolved edit."""

    index: int
    id: str
    image: str
    prompt: str
    seed: int
    width: int
    height: int
    prompt_embeds: Optional[str] = None


def _read_manifest(path: str) -> list[dict]:
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as err:
        raise WorkloadError(f"workload.manifest={path!r} cannot be read: {err.strerror}.")
    if file.suffix == ".jsonl":
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise WorkloadError(f"{path} line {n} is not valid JSON: {err.msg}.")
        return entries
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise WorkloadError(f"workload.manifest={path!r} is not valid YAML: {err}.")
    data = data.get("edits") if isinstance(data, dict) else data
    if not isinstance(data, list):
        raise WorkloadError(f"workload.manifest={path!r} must be a list of edits (or a mapping with 'edits:').")
    return data


def resolve_edits(workload_cfg) -> list[Edit]:
    """The run's edits in order, with defaults filled in and every field checked."""
    if workload_cfg.manifest:
        raw = _read_manifest(workload_cfg.manifest)
    else:
        raw = [dict(e) for e in workload_cfg.edits]
    if workload_cfg.limit is not None:
        raw = raw[: workload_cfg.limit]
    if not raw:
        raise WorkloadError("the workload has no edits: set workload.edits or workload.manifest.")
    edits = [_resolve_edit(i, entry, workload_cfg) for i, entry in enumerate(raw)]
    ids = [e.id for e in edits]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise WorkloadError(f"edit id {duplicate!r} appears twice in the workload; ids name output files.")
    return edits


def _resolve_edit(index: int, entry, workload_cfg) -> Edit:
    if not isinstance(entry, dict):
        raise WorkloadError(f"workload edit #{index} is not a mapping of {', '.join(_EDIT_KEYS)}.")
    name = entry.get("id") or f"edit{index:04d}"
    if not SAFE_ID.fullmatch(str(name)):
        raise WorkloadError(
            f"edit id {str(name)!r} is not a file stem; use letters, digits, '.', '_' and '-', starting with a "
            "letter or digit, at most 128 characters (ids name the output files)."
        )
    unknown = sorted(set(entry) - set(_EDIT_KEYS))
    if unknown:
        raise WorkloadError(f"edit {name!r} has unknown key {unknown[0]!r}; allowed: {', '.join(_EDIT_KEYS)}.")
    if not entry.get("image"):
        raise WorkloadError(f"edit {name!r} names no image (key 'image': skimage:<name> or a file path).")
    edit = Edit(
        index=index, id=str(name), image=str(entry["image"]), prompt=str(entry.get("prompt") or ""),
        seed=int(entry["seed"]) if entry.get("seed") is not None else workload_cfg.seed + index,
        width=int(entry.get("width") or workload_cfg.width), height=int(entry.get("height") or workload_cfg.height),
        prompt_embeds=entry.get("prompt_embeds"),
    )
    for key in ("width", "height"):
        value = getattr(edit, key)
        if value <= 0 or value % (2 * VAE_SCALE):
            raise WorkloadError(f"edit {edit.id!r} has {key}={value}; it must be a positive multiple of 16.")
    return edit


def check_sources(edits: list[Edit]) -> None:
    """Fail before any model is built if an image or embedding file does not exist."""
    from skimage import data as skdata

    for edit in edits:
        if edit.image.startswith("skimage:"):
            name = edit.image.split(":", 1)[1]
            if not callable(getattr(skdata, name, None)):
                raise WorkloadError(f"edit {edit.id!r}: scikit-image ships no image named {name!r}.")
        elif not Path(edit.image).is_file():
            raise WorkloadError(f"edit {edit.id!r}: image file {edit.image!r} does not exist.")
        if edit.prompt_embeds and not Path(edit.prompt_embeds).is_file():
            raise WorkloadError(f"edit {edit.id!r}: prompt_embeds file {edit.prompt_embeds!r} does not exist.")


def load_image(edit: Edit) -> torch.Tensor:
    """The reference image resized to the edit's output size. -> [1, 3, H, W] fp32 in [0, 1]."""
    from skimage import color, io, transform
    from skimage import data as skdata

    try:
        if edit.image.startswith("skimage:"):
            img = getattr(skdata, edit.image.split(":", 1)[1])()
        else:
            img = io.imread(edit.image)
    except Exception as err:  # any decoder failure is the same user-facing problem
        raise WorkloadError(f"edit {edit.id!r}: image {edit.image!r} cannot be read: {err}.")
    if img.ndim == 2:
        img = color.gray2rgb(img)
    img = img[..., :3]
    img = transform.resize(img, (edit.height, edit.width), anti_aliasing=True, preserve_range=False)
    return torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32)).permute(2, 0, 1)[None]


def _text_seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def standin_embeds(text: str, length: int, joint_dim: int, pooled_dim: int):
    """A deterministic stand-in for a text encoder: the same text always gives the same embeddings."""
    gen = torch.Generator().manual_seed(_text_seed(text))
    return torch.randn(1, length, joint_dim, generator=gen), torch.randn(1, pooled_dim, generator=gen)


def prompt_embeddings(edit: Edit, text_len: int, joint_dim: int, pooled_dim: int):
    """(prompt, pooled, negative prompt, negative pooled) for an edit, checked against the model."""
    neg = standin_embeds("", text_len, joint_dim, pooled_dim)
    if not edit.prompt_embeds:
        return (*standin_embeds(edit.prompt, text_len, joint_dim, pooled_dim), *neg)
    from safetensors.torch import load_file

    tensors = load_file(edit.prompt_embeds)
    for key in ("prompt_embeds", "pooled_prompt_embeds"):
        if key not in tensors:
            raise WorkloadError(f"edit {edit.id!r}: {edit.prompt_embeds} has no tensor {key!r}.")
    prompt, pooled = tensors["prompt_embeds"].float(), tensors["pooled_prompt_embeds"].float()
    if prompt.shape[-1] != joint_dim or pooled.shape[-1] != pooled_dim:
        raise WorkloadError(
            f"edit {edit.id!r}: embeddings are {prompt.shape[-1]}/{pooled.shape[-1]} wide, the model takes "
            f"joint_attention_dim={joint_dim}/pooled_projection_dim={pooled_dim}."
        )
    neg_prompt = tensors.get("negative_prompt_embeds", torch.zeros_like(prompt)).float()
    neg_pooled = tensors.get("negative_pooled_prompt_embeds", torch.zeros_like(pooled)).float()
    return prompt.reshape(1, -1, joint_dim), pooled.reshape(1, pooled_dim), \
        neg_prompt.reshape(1, -1, joint_dim), neg_pooled.reshape(1, pooled_dim)


def edit_inputs(edit: Edit, codec, geometry, text_len: int, device: torch.device) -> EditInputs:
    """Model inputs of one edit, deterministic in (edit, seed) and independent of the rank."""
    h, w = edit.height // VAE_SCALE, edit.width // VAE_SCALE
    ref = pack(codec.encode(load_image(edit).to(device)).float())
    gen = torch.Generator().manual_seed(edit.seed)
    noise = torch.randn(1, (h // 2) * (w // 2), geometry.in_channels, generator=gen)
    prompt, pooled, neg_prompt, neg_pooled = prompt_embeddings(
        edit, text_len, geometry.joint_attention_dim, geometry.pooled_projection_dim
    )
    if neg_prompt.shape[1] != prompt.shape[1]:
        neg_prompt = _fit_length(neg_prompt, prompt.shape[1])
    return EditInputs(
        noise=noise.to(device), ref_latents=ref, img_ids=token_ids(h, w, 0, device),
        ref_ids=token_ids(h, w, 1, device), prompt=prompt.to(device), pooled=pooled.to(device),
        neg_prompt=neg_prompt.to(device), neg_pooled=neg_pooled.to(device),
        txt_ids=torch.zeros(prompt.shape[1], 3, device=device),
    )


def _fit_length(x: torch.Tensor, length: int) -> torch.Tensor:
    """Pad with zeros or cut so that both CFG branches have the same text length (one rope table)."""
    if x.shape[1] >= length:
        return x[:, :length]
    return torch.cat([x, x.new_zeros(x.shape[0], length - x.shape[1], x.shape[2])], dim=1)


def edit_record(edit: Edit) -> dict:
    return dataclasses.asdict(edit)
