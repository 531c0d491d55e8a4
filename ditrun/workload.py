"""Workloads: which edits to run, and turning one edit into model inputs.

An edit is a reference image at its own size + a prompt embedding + a seed + an output size.
Edits come inline from ``workload.edits`` or from a YAML/JSONL manifest (``workload.manifest``).
Images are ``skimage:<name>`` (photographs shipped with scikit-image) or files; prompt
embeddings come from a safetensors file or, without one, a stand-in seeded by the prompt text.
Sizes, seeds and noise follow diffusers' ``FluxKontextPipeline`` (docs/WORKLOAD.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import yaml

from ditrun.errors import UserError
from ditrun.model.latents import LATENT_CHANNELS, VAE_SCALE, pack, token_ids
from ditrun.model.text import STANDIN_TEXT_LEN, model_text_len
from ditrun.model.sampler import EditInputs

_EDIT_KEYS = ("id", "image", "prompt", "prompt_embeds", "seed", "width", "height", "ref_width", "ref_height",
              "target")
# Pixel sizes are multiples of one packed latent token (2x2 latents of 8x8 pixels).
PATCH_PIXELS = 2 * VAE_SCALE
# The (width, height) FLUX.1 Kontext was trained at; diffusers snaps a reference to the one of the
# closest aspect ratio (pipeline_flux_kontext.PREFERRED_KONTEXT_RESOLUTIONS, the same list).
KONTEXT_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672),
)
# An edit id names its output files, so it must be a plain file stem: nothing that could climb
# out of the results directory, make a sub-folder or hide a file.
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# torch.Generator.manual_seed takes 0 .. 2**64 - 1 (a negative seed would alias a large one).
SEED_LIMIT = 2**64
# Tensors of an embeddings file: name -> (the token axis or not, the geometry field giving its width).
EMBEDDING_TENSORS = {
    "prompt_embeds": (True, "joint_attention_dim"),
    "pooled_prompt_embeds": (False, "pooled_projection_dim"),
    "negative_prompt_embeds": (True, "joint_attention_dim"),
    "negative_pooled_prompt_embeds": (False, "pooled_projection_dim"),
}
REQUIRED_EMBEDDINGS = ("prompt_embeds", "pooled_prompt_embeds")


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
    ref_width: int
    ref_height: int
    prompt_embeds: Optional[str] = None
    target: Optional[str] = None
    """The correct result: an edit name of ``ditrun.editor.transforms.EDITS`` or an image file."""


MAX_MANIFEST_BYTES = 64 * 2**20
"""The largest manifest read (about a million edits): a bound, so that a device (``/dev/zero``) or a wrong file
cannot fill the memory."""


def _read_manifest(path: str) -> list[dict]:
    file = Path(path)
    if file.exists() and not file.is_file():  # stat only: opening a FIFO would wait for a writer
        raise WorkloadError(f"workload.manifest={path!r} is {_not_regular(file)}; give a YAML or JSONL file.")
    try:
        size = file.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise WorkloadError(f"workload.manifest={path!r} is {size / 2**20:.0f} MiB; a manifest is at most "
                                f"{MAX_MANIFEST_BYTES // 2**20} MiB.")
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


def resolve_text_len(cfg) -> None:
    """``workload.text_len`` the user's, or the model's when unset (``text.model_text_len``), with
    ``workload.text_len_from`` saying which; once per config (a resolved config keeps its values)."""
    workload = cfg.workload
    if workload.text_len_from is not None and workload.text_len is not None:
        return
    if workload.text_len is not None:
        workload.text_len_from = "workload.text_len"
        return
    workload.text_len, workload.text_len_from = model_text_len(cfg.model.path)


def check_config(workload_cfg) -> None:
    """The numbers of ``workload.*``, checked before the edits are resolved (and before
    ``launcher.fault`` is checked against ``workload.steps``)."""
    limit, steps, text_len = workload_cfg.limit, workload_cfg.steps, workload_cfg.text_len
    if limit is not None and limit < 1:
        raise WorkloadError(f"workload.limit={limit} must be a positive number of edits, or unset for all of them.")
    if steps < 1:
        raise WorkloadError(f"workload.steps={steps} must be at least 1.")
    if text_len is not None and text_len < 1:
        raise WorkloadError(f"workload.text_len={text_len} must be a positive number of stand-in prompt tokens.")
    if workload_cfg.distilled_guidance is not None:
        raise WorkloadError("workload.distilled_guidance was renamed to diffusers' names: the distilled guidance value "
                            "is workload.guidance_scale and the true-CFG scale is workload.true_cfg_scale.")
    if workload_cfg.ref_resize not in REF_RESIZE:
        raise WorkloadError(f"workload.ref_resize={workload_cfg.ref_resize!r} is not a reference size rule; allowed: "
                            f"{', '.join(REF_RESIZE)}.")
    for key in ("guidance_scale", "true_cfg_scale"):
        value = getattr(workload_cfg, key)
        if not math.isfinite(value):
            raise WorkloadError(f"workload.{key}={value} must be a finite number.")
    _check_seed("workload.seed", workload_cfg.seed)


def _check_seed(where: str, seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise WorkloadError(f"{where}={seed} is not a noise seed; allowed: 0 to 2**64 - 1.")


def declared_edits(workload_cfg) -> list:
    """The workload's edits as written (the manifest's entries, or ``workload.edits``), before ``workload.limit``."""
    if workload_cfg.manifest:
        return _read_manifest(workload_cfg.manifest)
    return [dict(e) for e in workload_cfg.edits]


def resolve_edits(workload_cfg) -> list[Edit]:
    """The run's edits in order, with defaults filled in and every field checked."""
    raw = declared_edits(workload_cfg)
    _check_unique_ids(raw)
    if workload_cfg.limit is not None:
        raw = raw[: workload_cfg.limit]
    if not raw:
        raise WorkloadError("the workload has no edits: set workload.edits or workload.manifest.")
    return [_resolve_edit(i, entry, workload_cfg) for i, entry in enumerate(raw)]


def declared_id(index: int, entry) -> str:
    """The id of the workload's entry ``index`` as declared: its ``id``, else ``edit<index>``."""
    return str(entry.get("id") or f"edit{index:04d}") if isinstance(entry, dict) else f"edit{index:04d}"


def _check_unique_ids(raw: list) -> None:
    """Ids are unique over the whole workload, ``workload.limit`` or not: they name output files, and a results
    directory records every declared edit by id (a later entry would replace an earlier one there)."""
    first: dict[str, int] = {}
    for index, entry in enumerate(raw):
        name = declared_id(index, entry)
        if name in first:
            raise WorkloadError(f"edit id {name!r} appears twice in the workload (entries {first[name]} and {index}, "
                                "counting from 0); ids name output files.")
        first[name] = index


def _resolve_edit(index: int, entry, workload_cfg) -> Edit:
    if not isinstance(entry, dict):
        raise WorkloadError(f"workload edit #{index} is not a mapping of {', '.join(_EDIT_KEYS)}.")
    name = declared_id(index, entry)
    if not SAFE_ID.fullmatch(name):
        raise WorkloadError(
            f"edit id {str(name)!r} is not a file stem; use letters, digits, '.', '_' and '-', starting with a "
            "letter or digit, at most 128 characters (ids name the output files)."
        )
    unknown = sorted(set(entry) - set(_EDIT_KEYS))
    if unknown:
        raise WorkloadError(f"edit {name!r} has unknown key {unknown[0]!r}; allowed: {', '.join(_EDIT_KEYS)}.")
    if not entry.get("image"):
        raise WorkloadError(f"edit {name!r} names no image (key 'image': skimage:<name> or a file path).")
    defaults = {"seed": workload_cfg.seed + index, "width": workload_cfg.width, "height": workload_cfg.height,
                "ref_width": workload_cfg.ref_width, "ref_height": workload_cfg.ref_height}
    numbers = {key: _int_field(name, entry, key, default) for key, default in defaults.items()}
    for key in ("width", "height", "ref_width", "ref_height"):
        value = numbers[key]
        if value is not None and (value <= 0 or value % PATCH_PIXELS):
            source = "" if entry.get(key) is not None else f" (workload.{key})"
            raise WorkloadError(f"edit {name!r} has {key}={value}{source}; it must be a positive multiple of 16.")
    if (numbers["ref_width"] is None) != (numbers["ref_height"] is None):
        raise WorkloadError(f"edit {name!r} sets only one of ref_width and ref_height; set both, or neither to let "
                            f"workload.ref_resize={workload_cfg.ref_resize!r} decide.")
    edit = Edit(index=index, id=str(name), image=str(entry["image"]), prompt=str(entry.get("prompt") or ""),
                prompt_embeds=entry.get("prompt_embeds"), target=_target(name, entry.get("target")), **numbers)
    _check_seed(f"edit {edit.id!r}: seed", edit.seed)
    if edit.ref_width is None:
        ref_width, ref_height = REF_RESIZE[workload_cfg.ref_resize](edit)
        edit = dataclasses.replace(edit, ref_width=ref_width, ref_height=ref_height)
    return edit


def _names_an_edit(target: str) -> bool:
    from ditrun.editor.transforms import EDITS

    return target in EDITS


def _target(name: str, target) -> Optional[str]:
    """An edit's ``target``: a known edit's name, or an image file (checked from its header later)."""
    from ditrun.editor.transforms import EDITS

    if target is None or str(target) in EDITS:
        return None if target is None else str(target)
    if not isinstance(target, str) or not Path(target).exists():
        raise WorkloadError(f"edit {name!r} has target={target!r}; allowed: an edit name ({EDITS.allowed()}) or an "
                            "image file of the correct result.")
    return target


def target_image(edit: Edit) -> Optional[np.ndarray]:
    """The edit's correct result at its output size, as 8-bit RGB [H, W, 3] (None when no target is named): a
    named edit applied to the reference resized to the output size, or the target file resized to it."""
    if edit.target is None:
        return None
    from ditrun.editor.transforms import EDITS, apply
    from ditrun.metrics.results import to_rgb8

    if edit.target in EDITS:
        source = dataclasses.replace(edit, ref_width=edit.width, ref_height=edit.height)
        return to_rgb8(apply(edit.target, load_image(source)))
    picture = dataclasses.replace(edit, image=edit.target, ref_width=edit.width, ref_height=edit.height)
    _check_image_file(edit, "target", edit.target)
    return to_rgb8(load_image(picture))


def _snap_down(size: int) -> int:
    return size // PATCH_PIXELS * PATCH_PIXELS


def _own_size(edit: Edit) -> tuple[int, int]:
    """The image's (width, height) rounded down to the patch grid (diffusers' get_default_height_width)."""
    width, height = image_size(edit)
    if min(width, height) < PATCH_PIXELS:
        raise WorkloadError(f"edit {edit.id!r}: image {edit.image!r} is {width}x{height} pixels; a reference needs "
                            f"at least {PATCH_PIXELS} each way (or set ref_width and ref_height).")
    return _snap_down(width), _snap_down(height)


def _kontext_size(edit: Edit) -> tuple[int, int]:
    """The preferred Kontext resolution whose aspect ratio is closest to the image's (ties: the first)."""
    width, height = _own_size(edit)
    _, w, h = min((abs(width / height - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return _snap_down(w), _snap_down(h)


# workload.ref_resize: how an edit without ref_width/ref_height sizes its reference -> (width, height).
REF_RESIZE = {
    "output": lambda edit: (edit.width, edit.height),
    "kontext": _kontext_size,
    "none": _own_size,
}


def image_size(edit: Edit) -> tuple[int, int]:
    """(width, height) of the edit's image, from a file's header or a scikit-image picture's array."""
    if edit.image.startswith("skimage:"):
        height, width = _skimage_shape(edit)
        return width, height
    from PIL import Image

    _check_image_file(edit, "image", edit.image)
    with Image.open(edit.image) as picture:
        return picture.size


def _int_field(name: str, entry: dict, key: str, default: int) -> int:
    value = entry.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"edit {name!r} has {key}={value!r}; it must be an integer.")
    return value


def check_sources(edits: list[Edit]) -> None:
    """Fail before any model is built if an image, target or embedding file does not exist, or an image or target
    is not a picture ditrun can read (files: from their headers; skimage pictures: their pixels)."""
    for edit in edits:
        if edit.image.startswith("skimage:"):
            _check_pixels(edit, _skimage_pixels(edit))
        else:
            _check_image_file(edit, "image", edit.image)
        if edit.target is not None and not _names_an_edit(edit.target):
            _check_image_file(edit, "target", edit.target)
        if edit.prompt_embeds:
            _check_regular_file(edit, "prompt_embeds", edit.prompt_embeds)


def check_inputs(edits: list[Edit], geometry) -> None:
    """Every edit's image and embeddings, from headers where files allow, before any model is built."""
    check_sources(edits)
    check_embeddings(edits, geometry)


# PIL modes of the pictures ditrun converts to RGB: 1-bit, grey (8/16 bit), grey + alpha, palette, RGB(A).
IMAGE_MODES = ("1", "L", "I;16", "I;16L", "I;16B", "LA", "P", "PA", "RGB", "RGBA")


def _check_image_file(edit: Edit, what: str, path: str) -> None:
    """Reads the header of the edit's ``what`` (``image`` or ``target``) file ``path`` only: format, mode and
    number of frames."""
    from PIL import Image, UnidentifiedImageError

    _check_regular_file(edit, what, path)
    where = f"edit {edit.id!r}: {what} file {path!r}"
    try:
        with Image.open(path) as picture:
            mode, frames = picture.mode, getattr(picture, "n_frames", 1)
    except Image.DecompressionBombError as err:
        raise WorkloadError(f"{where} is too large to decode safely ({err}); give a smaller picture.")
    except (UnidentifiedImageError, OSError) as err:
        raise WorkloadError(f"{where} is not a picture PIL can read ({err}).")
    if mode not in IMAGE_MODES:
        raise WorkloadError(f"{where} has PIL mode {mode!r}; allowed: {', '.join(IMAGE_MODES)} (convert it to RGB).")
    if frames != 1:
        raise WorkloadError(f"{where} holds {frames} frames; give one picture.")


def _check_regular_file(edit: Edit, what: str, path: str) -> None:
    """A file to read must be a regular file: a directory or a device (``/dev/zero`` never ends) is refused."""
    file = Path(path)
    if file.is_file():
        return
    if not file.exists():
        raise WorkloadError(f"edit {edit.id!r}: {what} file {path!r} does not exist.")
    raise WorkloadError(f"edit {edit.id!r}: {what} file {path!r} is {_not_regular(file)}; give a file.")


def _not_regular(file: Path) -> str:
    """What an existing path that is not a regular file is, for an error message."""
    return "a directory" if file.is_dir() else "not a regular file (a device, pipe or socket)"


def _skimage_shape(edit: Edit) -> tuple[int, int]:
    """(height, width) of a scikit-image picture, loaded once per process."""
    return _cached_skimage_shape(edit.image, edit.id)


@lru_cache(maxsize=None)
def _cached_skimage_shape(image: str, edit_id: str) -> tuple[int, int]:
    edit = Edit(index=0, id=edit_id, image=image, prompt="", seed=0, width=0, height=0, ref_width=0, ref_height=0)
    pixels = _skimage_pixels(edit)
    _check_pixels(edit, pixels)
    return tuple(pixels.shape[:2])


def _skimage_pixels(edit: Edit) -> np.ndarray:
    from skimage import data as skdata

    name = edit.image.split(":", 1)[1]
    if not callable(getattr(skdata, name, None)):
        raise WorkloadError(f"edit {edit.id!r}: scikit-image ships no image named {name!r}.")
    try:
        return getattr(skdata, name)()
    except Exception as err:  # e.g. a picture scikit-image must download first, with no network
        raise WorkloadError(f"edit {edit.id!r}: scikit-image cannot provide {name!r} ({type(err).__name__}: {err}).")


def _check_pixels(edit: Edit, pixels) -> None:
    """A picture is [H, W] (grey) or [H, W, C] with C = 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA)."""
    shape = getattr(pixels, "shape", None)
    ok = shape is not None and (len(shape) == 2 or (len(shape) == 3 and 1 <= shape[2] <= 4))
    if not ok or not (np.issubdtype(pixels.dtype, np.number) or pixels.dtype == bool) or min(shape) < 1:
        what = f"an array of shape {tuple(shape)}" if shape is not None else f"a {type(pixels).__name__}"
        raise WorkloadError(f"edit {edit.id!r}: image {edit.image!r} is {what}, not a grey, grey+alpha, RGB or "
                            "RGBA picture.")


def to_rgb(pixels: np.ndarray) -> np.ndarray:
    """A checked picture as RGB floats in [0, 1]: booleans become 0 and 1, integers are scaled by
    their type's range, grey is repeated into R, G and B, and alpha is dropped (taken as opaque).

    pixels: [H, W] or [H, W, C], C in 1..4 -> [H, W, 3] float
    """
    from skimage.util import img_as_float

    rgb = img_as_float(pixels)
    if rgb.ndim == 3 and rgb.shape[2] <= 2:
        rgb = rgb[..., 0]
    if rgb.ndim == 2:
        rgb = np.repeat(rgb[..., None], 3, axis=2)
    return rgb[..., :3]


def load_image(edit: Edit) -> torch.Tensor:
    """The reference image at the edit's reference size. -> [1, 3, ref_height, ref_width] fp32 in [0, 1].

    Resized as diffusers' VaeImageProcessor does (8-bit RGB, PIL Lanczos), so that a reference
    made here is the one a diffusers run of the same picture encodes.
    """
    from PIL import Image
    from skimage import io

    if edit.image.startswith("skimage:"):
        pixels = _skimage_pixels(edit)
    else:
        try:
            pixels = io.imread(edit.image)
        except Exception as err:  # any decoder failure is the same user-facing problem
            raise WorkloadError(f"edit {edit.id!r}: image {edit.image!r} cannot be read: {err}.")
    _check_pixels(edit, pixels)
    rgb8 = np.round(to_rgb(pixels) * 255).astype(np.uint8)
    picture = Image.fromarray(rgb8).resize((edit.ref_width, edit.ref_height), resample=Image.LANCZOS)
    img = np.asarray(picture, dtype=np.float32) / 255
    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None]


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
            raise WorkloadError(f"edit {edit.id!r}: prompt_embeds file {edit.prompt_embeds!r} is not a safetensors "
                                f"file ({err}).")
        for name, (dtype, shape) in header.items():
            if name in EMBEDDING_TENSORS and dtype not in ("F64", "F32", "F16", "BF16"):
                raise WorkloadError(f"edit {edit.id!r}: {name} in {edit.prompt_embeds} is {dtype}; embeddings are floats.")
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
            raise WorkloadError(f"edit {edit.id!r}: {name} in {edit.prompt_embeds} has shape {list(shape)}; "
                                f"allowed: {allowed} ({width_key}={width}).")


def edit_tokens(edit: Edit, text_len: int) -> int:
    """Tokens of the edit's joint sequence: text (the embeddings file's length, read from its header,
    or ``text_len``) + output latents + reference latents."""
    text = text_len
    if edit.prompt_embeds:
        from safetensors import safe_open

        with safe_open(edit.prompt_embeds, framework="pt") as f:
            text = f.get_slice("prompt_embeds").get_shape()[-2]
    return text + (edit.height // PATCH_PIXELS) * (edit.width // PATCH_PIXELS) \
        + (edit.ref_height // PATCH_PIXELS) * (edit.ref_width // PATCH_PIXELS)


def prompt_embeddings(edit: Edit, text_len: Optional[int], geometry):
    """(prompt, pooled, negative prompt, negative pooled) for an edit, checked against the model.

    -> [1, L, joint_dim], [1, pooled_dim], [1, L', joint_dim], [1, pooled_dim]
    """
    joint_dim, pooled_dim = geometry.joint_attention_dim, geometry.pooled_projection_dim
    if not edit.prompt_embeds:  # stand-ins: no pipeline folder encodes prompts here, so unset is their length
        length = STANDIN_TEXT_LEN if text_len is None else text_len
        return (*standin_embeds(edit.prompt, length, joint_dim, pooled_dim),
                *standin_embeds("", length, joint_dim, pooled_dim))
    from safetensors.torch import load_file

    tensors = load_file(edit.prompt_embeds)
    _check_embedding_shapes(edit, {name: t.shape for name, t in tensors.items()}, geometry)
    prompt, pooled = tensors["prompt_embeds"].float(), tensors["pooled_prompt_embeds"].float()
    neg_prompt = tensors.get("negative_prompt_embeds", torch.zeros_like(prompt)).float()
    neg_pooled = tensors.get("negative_pooled_prompt_embeds", torch.zeros_like(pooled)).float()
    return prompt.reshape(1, -1, joint_dim), pooled.reshape(1, pooled_dim), \
        neg_prompt.reshape(1, -1, joint_dim), neg_pooled.reshape(1, pooled_dim)


def initial_noise(seed: int, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' initial latents: [1, 16, h, w] drawn in ``dtype`` from a CPU generator seeded with
    ``seed`` (``generator=torch.Generator("cpu").manual_seed(seed)`` there), then packed.

    -> [1, (h/2)(w/2), 64] fp32, h and w the latent size (pixels / 8)
    """
    gen = torch.Generator().manual_seed(seed)
    return pack(torch.randn(1, LATENT_CHANNELS, height, width, generator=gen, dtype=dtype)).float()


def edit_inputs(edit: Edit, codec, geometry, workload_cfg, device: torch.device,
                dtype: torch.dtype = torch.float32) -> EditInputs:
    """Model inputs of one edit, deterministic in (edit, seed, dtype) and independent of the rank.

    ``dtype`` is the model's compute dtype, the one diffusers draws its noise in. With true CFG off
    (``true_cfg_scale`` <= 1, as diffusers decides) there is no unconditional branch to feed.
    """
    h, w = edit.height // VAE_SCALE, edit.width // VAE_SCALE
    ref_h, ref_w = edit.ref_height // VAE_SCALE, edit.ref_width // VAE_SCALE
    ref = pack(codec.encode(load_image(edit).to(device)).float())
    prompt, pooled, neg_prompt, neg_pooled = prompt_embeddings(edit, workload_cfg.text_len, geometry)
    inputs = EditInputs(
        noise=initial_noise(edit.seed, h, w, dtype).to(device), ref_latents=ref,
        img_ids=token_ids(h, w, 0, device), ref_ids=token_ids(ref_h, ref_w, 1, device),
        prompt=prompt.to(device), pooled=pooled.to(device), txt_ids=torch.zeros(prompt.shape[1], 3, device=device),
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


def edit_record(edit: Edit) -> dict:
    return dataclasses.asdict(edit)
