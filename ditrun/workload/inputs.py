"""An edit turned into the model's inputs: the reference's latents, the prompt's embeddings (a file, or a stand-in
seeded by the prompt text), the initial noise (diffusers' convention) and the token positions."""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

from ditrun.model.folders import STANDIN_TEXT_LEN
from ditrun.model.latents import LATENT_CHANNELS, VAE_SCALE, pack, token_ids
from ditrun.model.sampler import EditInputs
from ditrun.workload.edit import Edit, WorkloadError
from ditrun.workload.images import PATCH_PIXELS, check_sources, load_image

# Tensors of an embeddings file: name -> (the token axis or not, the geometry field giving its width).
EMBEDDING_TENSORS = {
    "prompt_embeds": (True, "joint_attention_dim"),
    "pooled_prompt_embeds": (False, "pooled_projection_dim"),
    "negative_prompt_embeds": (True, "joint_attention_dim"),
    "negative_pooled_prompt_embeds": (False, "pooled_projection_dim"),
}


REQUIRED_EMBEDDINGS = ("prompt_embeds", "pooled_prompt_embeds")


def check_inputs(edits: list[Edit], geometry) -> None:
    """Every edit's image and embeddings, from headers where files allow, before any model is built."""
    check_sources(edits)
    check_embeddings(edits, geometry)


def _text_seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def standin_embeds(text: str, length: int, joint_dim: int, pooled_dim: int):
    """A deterministic stand-in for a text encoder: the same text always gives the same embeddings."""
    gen = torch.Generator().manual_seed(_text_seed(text))
    return torch.randn(1, length, joint_dim, generator=gen), torch.randn(1, pooled_dim, generator=gen)


def check_embeddings(edits: list[Edit], geometry) -> None:
    """Every embeddings file's tensor names, dtypes and shapes against the model, from the safetensors
    header alone (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    for edit in edits:
        if not edit.prompt_embeds:
            continue
        try:
            with safe_open(edit.prompt_embeds, framework="pt") as f:
                header = {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}
        except (SafetensorError, OSError) as err:
            raise WorkloadError(
                f"edit {edit.id!r}: prompt_embeds file {edit.prompt_embeds!r} is not a safetensors file ({err})."
            )
        for name, (dtype, _shape) in header.items():
            if name in EMBEDDING_TENSORS and dtype not in ("F64", "F32", "F16", "BF16"):
                raise WorkloadError(
                    f"edit {edit.id!r}: {name} in {edit.prompt_embeds} is {dtype}; embeddings are floats."
                )
        _check_embedding_shapes(edit, {name: shape for name, (_, shape) in header.items()}, geometry)


def _check_embedding_shapes(edit: Edit, shapes: dict, geometry) -> None:
    """Token embeddings are [L, D] or [1, L, D] with D = joint_attention_dim; pooled ones [P] or
    [1, P] with P = pooled_projection_dim. Anything else (a batch of prompts, say) is refused,
    never reshaped."""
    for name in REQUIRED_EMBEDDINGS:
        if name not in shapes:
            raise WorkloadError(f"edit {edit.id!r}: {edit.prompt_embeds} has no tensor {name!r}.")
    for name, (tokens, width_key) in EMBEDDING_TENSORS.items():
        if name not in shapes:
            continue
        shape, width = tuple(shapes[name]), getattr(geometry, width_key)
        body = shape[1:] if len(shape) == (3 if tokens else 2) and shape[0] == 1 else shape
        if len(body) != (2 if tokens else 1) or body[-1] != width or (tokens and body[0] < 1):
            allowed = f"[L, {width}] or [1, L, {width}]" if tokens else f"[{width}] or [1, {width}]"
            raise WorkloadError(
                f"edit {edit.id!r}: {name} in {edit.prompt_embeds} has shape {list(shape)}; "
                f"allowed: {allowed} ({width_key}={width})."
            )


def edit_tokens(edit: Edit, text_len: int) -> int:
    """Tokens of the edit's joint sequence: text (the embeddings file's length, read from its header,
    or ``text_len``) + output latents + reference latents."""
    text = text_len
    if edit.prompt_embeds:
        from safetensors import safe_open

        with safe_open(edit.prompt_embeds, framework="pt") as f:
            text = f.get_slice("prompt_embeds").get_shape()[-2]
    return text + image_tokens(edit)


def image_tokens(edit: Edit) -> int:
    """Tokens of the edit's output latents and its reference's, one sequence in the model."""
    output = (edit.height // PATCH_PIXELS) * (edit.width // PATCH_PIXELS)
    return output + (edit.ref_height // PATCH_PIXELS) * (edit.ref_width // PATCH_PIXELS)


def prompt_embeddings(edit: Edit, text_len: Optional[int], geometry):
    """(prompt, pooled, negative prompt, negative pooled) for an edit, checked against the model.

    -> [1, L, joint_dim], [1, pooled_dim], [1, L', joint_dim], [1, pooled_dim]
    """
    joint_dim, pooled_dim = geometry.joint_attention_dim, geometry.pooled_projection_dim
    if not edit.prompt_embeds:  # stand-ins: no pipeline folder encodes prompts here, so unset is their length
        length = STANDIN_TEXT_LEN if text_len is None else text_len
        return (
            *standin_embeds(edit.prompt, length, joint_dim, pooled_dim),
            *standin_embeds("", length, joint_dim, pooled_dim),
        )
    from safetensors.torch import load_file

    tensors = load_file(edit.prompt_embeds)
    _check_embedding_shapes(edit, {name: t.shape for name, t in tensors.items()}, geometry)
    prompt, pooled = tensors["prompt_embeds"].float(), tensors["pooled_prompt_embeds"].float()
    neg_prompt = tensors.get("negative_prompt_embeds", torch.zeros_like(prompt)).float()
    neg_pooled = tensors.get("negative_pooled_prompt_embeds", torch.zeros_like(pooled)).float()
    return (
        prompt.reshape(1, -1, joint_dim),
        pooled.reshape(1, pooled_dim),
        neg_prompt.reshape(1, -1, joint_dim),
        neg_pooled.reshape(1, pooled_dim),
    )


def initial_noise(seed: int, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' initial latents: [1, 16, h, w] drawn in ``dtype`` from a CPU generator seeded with
    ``seed`` (``generator=torch.Generator("cpu").manual_seed(seed)`` there), then packed.

    -> [1, (h/2)(w/2), 64] fp32, h and w the latent size (pixels / 8)
    """
    gen = torch.Generator().manual_seed(seed)
    return pack(torch.randn(1, LATENT_CHANNELS, height, width, generator=gen, dtype=dtype)).float()


def edit_inputs(
    edit: Edit, codec, geometry, workload_cfg, device: torch.device, dtype: torch.dtype = torch.float32
) -> EditInputs:
    """Model inputs of one edit, deterministic in (edit, seed, dtype) and independent of the rank.

    ``dtype`` is the model's compute dtype, the one diffusers draws its noise in. With true CFG off
    (``true_cfg_scale`` <= 1, as diffusers decides) there is no unconditional branch to feed.
    """
    h, w = edit.height // VAE_SCALE, edit.width // VAE_SCALE
    ref_h, ref_w = edit.ref_height // VAE_SCALE, edit.ref_width // VAE_SCALE
    ref = pack(codec.encode(load_image(edit).to(device)).float())
    prompt, pooled, neg_prompt, neg_pooled = prompt_embeddings(edit, workload_cfg.text_len, geometry)
    inputs = EditInputs(
        noise=initial_noise(edit.seed, h, w, dtype).to(device),
        ref_latents=ref,
        img_ids=token_ids(h, w, 0, device),
        ref_ids=token_ids(ref_h, ref_w, 1, device),
        prompt=prompt.to(device),
        pooled=pooled.to(device),
        txt_ids=torch.zeros(prompt.shape[1], 3, device=device),
    )
    if workload_cfg.true_cfg_scale > 1:
        inputs.neg_prompt = _fit_length(neg_prompt, prompt.shape[1]).to(device)
        inputs.neg_pooled = neg_pooled.to(device)
    return inputs


def _fit_length(x: torch.Tensor, length: int) -> torch.Tensor:
    """Pad with zeros or cut so that both CFG branches have the same text length (one rope table)."""
    if x.shape[1] >= length:
        return x[:, :length]
    return torch.cat([x, x.new_zeros(x.shape[0], length - x.shape[1], x.shape[2])], dim=1)
