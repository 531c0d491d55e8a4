"""An edit's pictures: the reference image's size and pixels (a picture shipped in a package, ``skimage:<name>``,
``matplotlib:<file>`` or ``sklearn:<file>``, or a file), the size a reference is
resized to (diffusers' ``FluxKontextPipeline`` rules, docs/WORKLOAD.md), the correct result where one is named,
and the checks that every picture and file exists and can be read, from headers where files allow."""

from __future__ import annotations

import dataclasses
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ditrun.model.latents import VAE_SCALE
from ditrun.workload.edit import Edit, WorkloadError

# Pixel sizes are multiples of one packed latent token (2x2 latents of 8x8 pixels).
PATCH_PIXELS = 2 * VAE_SCALE
# Pictures shipped inside installed packages, named <package>:<name>: a function of skimage.data (a stereo pair: its
# left view), a file of matplotlib's sample_data, a file of scikit-learn's sample images.
PICTURE_PACKAGES = ("skimage", "matplotlib", "sklearn")


def is_package_picture(image: str) -> bool:
    """Whether ``image`` names a picture shipped in a package (its name is its identity) rather than a file."""
    package, sep, _ = image.partition(":")
    return bool(sep) and package in PICTURE_PACKAGES


def package_file(image: str) -> Optional[str]:
    """The file inside its package of a ``matplotlib:`` or ``sklearn:`` picture (None for any other name); it may
    not exist."""
    package, _, name = image.partition(":")
    if package == "matplotlib":
        import matplotlib

        return os.path.join(matplotlib.get_data_path(), "sample_data", name)
    if package == "sklearn":
        import sklearn.datasets

        return os.path.join(os.path.dirname(sklearn.datasets.__file__), "images", name)
    return None


def skimage_ships(name: str) -> bool:
    """Whether ``skimage.data`` has a picture function ``name`` (without calling it)."""
    from skimage import data as skdata

    return not name.startswith("_") and callable(getattr(skdata, name, None))


def skimage_picture(name: str) -> np.ndarray:
    """The pixels of ``skimage.data.<name>()``, a stereo pair's left view; LookupError (one sentence) where
    scikit-image ships no such picture."""
    from skimage import data as skdata

    if not skimage_ships(name):
        raise LookupError(f"scikit-image ships no image named {name!r}")
    pixels = getattr(skdata, name)()
    return pixels[0] if isinstance(pixels, tuple) else pixels


# The (width, height) FLUX.1 Kontext was trained at; diffusers snaps a reference to the one of the
# closest aspect ratio (pipeline_flux_kontext.PREFERRED_KONTEXT_RESOLUTIONS, the same list).
KONTEXT_RESOLUTIONS = (
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
)


def target_image(edit: Edit) -> Optional[np.ndarray]:
    """The edit's correct result at its output size, as 8-bit RGB [H, W, 3] (None when no target is named): a
    named edit applied to the reference resized to the output size, or the target file resized to it."""
    if edit.target is None:
        return None
    from ditrun.editor.transforms import EDITS, apply
    from ditrun.results.files import to_rgb8

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
        raise WorkloadError(
            f"edit {edit.id!r}: image {edit.image!r} is {width}x{height} pixels; a reference needs "
            f"at least {PATCH_PIXELS} each way (or set ref_width and ref_height)."
        )
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

    path = _image_path(edit)
    _check_image_file(edit, "image", path)
    with Image.open(path) as picture:
        return picture.size


def _image_path(edit: Edit) -> str:
    """The file of the edit's image: its path, or the file inside its package (one sentence where it ships none)."""
    path = package_file(edit.image)
    if path is None:
        return edit.image
    if not os.path.isfile(path):
        package, _, name = edit.image.partition(":")
        raise WorkloadError(f"edit {edit.id!r}: {package} ships no sample picture named {name!r}.")
    return path


def check_sources(edits: list[Edit]) -> None:
    """Fail before any model is built if an image, target or embedding file does not exist, or an image or target
    is not a picture ditrun can read (files: from their headers; skimage pictures: their pixels)."""
    from ditrun.editor.transforms import EDITS

    for edit in edits:
        if edit.image.startswith("skimage:"):
            _check_pixels(edit, _skimage_pixels(edit))
        else:
            _check_image_file(edit, "image", _image_path(edit))
        if edit.target is not None and edit.target not in EDITS:
            _check_image_file(edit, "target", edit.target)
        if edit.prompt_embeds:
            _check_regular_file(edit, "prompt_embeds", edit.prompt_embeds)


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
    raise WorkloadError(f"edit {edit.id!r}: {what} file {path!r} is {not_regular(file)}; give a file.")


def not_regular(file: Path) -> str:
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
    name = edit.image.split(":", 1)[1]
    try:
        return skimage_picture(name)
    except LookupError as err:
        raise WorkloadError(f"edit {edit.id!r}: {err}.")
    except Exception as err:  # e.g. a picture scikit-image must download first, with no network
        raise WorkloadError(f"edit {edit.id!r}: scikit-image cannot provide {name!r} ({type(err).__name__}: {err}).")


def _check_pixels(edit: Edit, pixels) -> None:
    """A picture is [H, W] (grey) or [H, W, C] with C = 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA)."""
    shape = getattr(pixels, "shape", None)
    ok = shape is not None and (len(shape) == 2 or (len(shape) == 3 and 1 <= shape[2] <= 4))
    if not ok or not (np.issubdtype(pixels.dtype, np.number) or pixels.dtype == bool) or min(shape) < 1:
        what = f"an array of shape {tuple(shape)}" if shape is not None else f"a {type(pixels).__name__}"
        raise WorkloadError(
            f"edit {edit.id!r}: image {edit.image!r} is {what}, not a grey, grey+alpha, RGB or RGBA picture."
        )


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
        path = _image_path(edit)
        try:
            pixels = io.imread(path)
        except Exception as err:  # any decoder failure is the same user-facing problem
            raise WorkloadError(f"edit {edit.id!r}: image {edit.image!r} cannot be read: {err}.")
    _check_pixels(edit, pixels)
    rgb8 = np.round(to_rgb(pixels) * 255).astype(np.uint8)
    picture = Image.fromarray(rgb8).resize((edit.ref_width, edit.ref_height), resample=Image.LANCZOS)
    img = np.asarray(picture, dtype=np.float32) / 255
    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None]
