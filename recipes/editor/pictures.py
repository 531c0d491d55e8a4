"""The editor's pictures: photographs and drawings shipped inside installed packages, nothing downloaded.

A picture is named ``<package>:<name>``: ``skimage:<function in skimage.data>``,
``matplotlib:<file in matplotlib's sample_data>`` or ``sklearn:<file of sklearn.datasets.load_sample_image>``.
``HELD_OUT`` (the default run's four photographs and four more) never enter training; ``EXCLUDED`` are
left out of both (a second view of a held-out scene, and pictures too small to crop).
"""

from __future__ import annotations

import os

import numpy as np

from ditrun.workload.images import PICTURE_PACKAGES, package_file, skimage_picture, skimage_ships, to_rgb

HELD_OUT = (
    "skimage:astronaut",
    "skimage:coffee",
    "skimage:chelsea",
    "skimage:rocket",
    "matplotlib:grace_hopper.jpg",
    "skimage:stereo_motorcycle",
    "skimage:camera",
    "skimage:coins",
)
TRAIN = (
    "skimage:brick",
    "skimage:cell",
    "skimage:colorwheel",
    "skimage:grass",
    "skimage:gravel",
    "skimage:horse",
    "skimage:hubble_deep_field",
    "skimage:immunohistochemistry",
    "skimage:logo",
    "skimage:moon",
    "skimage:page",
    "skimage:retina",
    "skimage:text",
    "skimage:clock",
    "skimage:shepp_logan_phantom",
    "matplotlib:Minduka_Present_Blue_Pack.png",
    "matplotlib:logo2.png",
    "sklearn:china.jpg",
    "sklearn:flower.jpg",
)
EXCLUDED = (
    "skimage:stereo_motorcycle (right view)",
    "skimage:microaneurysms",
    "skimage:checkerboard",
    "skimage:lfw_subset",
)
PACKAGES = PICTURE_PACKAGES
# Where each package's pictures come from, and their licences (docs/EDITOR.md).
SOURCES = {
    "skimage": "scikit-image's skimage.data (public domain or CC0/CC-BY pictures; see skimage/data/README.txt)",
    "matplotlib": "matplotlib's sample_data (grace_hopper.jpg: public domain, US Navy; the rest matplotlib's own)",
    "sklearn": "scikit-learn's sample images (china.jpg, flower.jpg: CC-BY 2.0, "
    "see sklearn/datasets/images/README.txt)",
}


def load(name: str) -> np.ndarray:
    """A picture as RGB floats in [0, 1], [H, W, 3] (grey repeated into R, G and B, alpha dropped), read as ditrun's
    workload reads the same name."""
    package, item = name.split(":", 1)
    if package not in PACKAGES:
        raise ValueError(f"picture {name!r}: allowed packages: {', '.join(PACKAGES)}")
    if package == "skimage":
        pixels = skimage_picture(item)
    else:
        from skimage import io

        pixels = io.imread(package_file(name))
    return np.ascontiguousarray(to_rgb(pixels), dtype=np.float32)


def exists(name: str) -> bool:
    """Whether ``name`` is a picture ``load`` can read, without reading it (the check before any work)."""
    package, _, item = name.partition(":")
    if package == "skimage":
        return skimage_ships(item)
    path = package_file(name)
    return path is not None and os.path.isfile(path)


def is_grey(picture: np.ndarray) -> bool:
    return bool(np.allclose(picture[..., 0], picture[..., 1]) and np.allclose(picture[..., 1], picture[..., 2]))
