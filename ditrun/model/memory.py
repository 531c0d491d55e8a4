"""Will the largest edit fit? An estimate of one rank's peak memory from the model's geometry and
the edit's token count, compared with what the device has free, before any model is built.

The estimate is weights + activations (+ the decoded image on a CPU):

* weights: the parameter count (the model built on the ``meta`` device, which costs nothing)
  times the widest dtype the run builds it in (its own, or the reference runs');
* activations: ``ACTIVATION_ELEMENTS_PER_TOKEN`` channels' worth of elements per token of the
  joint sequence, for the tokens one rank holds (the sequence is split over the SP group;
  ``cfg_batch`` stacks both CFG branches). A single-stream block holds its input, the modulated
  input, Q, K, V, the attention output, the MLP projection and its activation and their
  concatenation at once: about 24 x inner_dim elements per token for a GELU MLP (measured
  24-44 on CPUs with the ``tiny`` and ``small`` presets at 512-1024 px: small edits carry
  fixed overheads) and 40 for SwiGLU, whose projection is twice as wide. Attention itself adds
  no S x S term: PyTorch's fused kernels (flash / memory-efficient on GPUs, flash on CPUs)
  never hold the score matrix;
* on a CPU, the reference image resized in float64 (a few copies of H x W x 3).

It is meant to refuse edits that cannot fit (the issue's case: a 96 GiB allocation after the
model was built), not to predict the peak to the byte.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ditrun.errors import UserError
from ditrun.model.dit import DiTGeometry, FluxDiT

GIB = 2**30
# Live elements per token and channel of inner_dim in a block (see the module docstring): the
# fixed part, and the part per MLP projection width (in units of inner_dim).
ACTIVATION_BASE = 8
ACTIVATION_PER_MLP_WIDTH = 4
# Float64 H x W x 3 copies alive while the reference image is converted and resized.
IMAGE_COPIES = 3


class OutOfMemoryError(UserError):
    """An edit that would not fit in the memory the device has free; the message names it."""


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's peak bytes for one edit, by part."""

    weights: int
    activations: int
    image: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.image


def parameter_count(geometry: DiTGeometry) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in FluxDiT(geometry).parameters())


def activation_elements_per_token(geometry: DiTGeometry) -> int:
    mlp_width = geometry.mlp_hidden_dim * (2 if geometry.mlp == "swiglu" else 1)
    return ACTIVATION_BASE * geometry.inner_dim + ACTIVATION_PER_MLP_WIDTH * mlp_width


def estimate(
    geometry: DiTGeometry,
    tokens: int,
    pixels: int,
    weight_bytes: int,
    activation_bytes: int,
    params: int,
    ranks_per_sequence: int = 1,
    batch: int = 1,
    on_host: bool = False,
) -> MemoryEstimate:
    """``tokens``: the joint sequence (text + output + reference); ``pixels``: output H x W;
    ``ranks_per_sequence``: the SP degree that splits it; ``batch``: 2 when both CFG branches are stacked."""
    per_rank_tokens = -(-tokens // ranks_per_sequence) * batch
    return MemoryEstimate(
        weights=params * weight_bytes,
        activations=per_rank_tokens * activation_elements_per_token(geometry) * activation_bytes,
        image=pixels * 3 * 8 * IMAGE_COPIES if on_host else 0,
    )


def free_bytes(device: torch.device) -> int:
    """What the device can still give: ``mem_get_info`` on a GPU (CUDA or ROCm), available RAM on a CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_bytes()


def available_host_bytes() -> int:
    """MemAvailable, or less where a cgroup (a container, a Slurm job's allocation) limits this process."""
    available = _meminfo_available()
    limit = _cgroup_room()
    return min(available, limit) if limit is not None else available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_room() -> Optional[int]:
    """Bytes left under this process's cgroup v2 memory limit, or None without one."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        folder = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None


def check_fits(
    edit_id: str, size: str, tokens: int, need: MemoryEstimate, free: int, device: torch.device, ranks_here: int = 1
) -> None:
    """Refuse the edit when ``ranks_here`` ranks sharing the device's memory would need more than is free."""
    if need.total * ranks_here <= free:
        return
    sharing = f" x {ranks_here} ranks sharing this machine's memory" if ranks_here > 1 else ""
    raise OutOfMemoryError(
        f"edit {edit_id!r} ({size}, {tokens} tokens) needs about {need.total / GIB:.1f} GiB per rank on "
        f"{device.type}{sharing} (weights {need.weights / GIB:.1f} + activations {need.activations / GIB:.1f}"
        f" + image {need.image / GIB:.1f} GiB) but only {free / GIB:.1f} GiB is free; make it smaller "
        f"(width/height) or split its sequence over more workers (layout=ulysses)."
    )


def check_memory(
    edits, tokens: dict[str, int], element_size: int, geometry: DiTGeometry, plan, placement, ranks_here: int = 1
) -> None:
    """Refuse the run when its largest edit cannot fit on this rank's device (see the module docstring).

    ``edits``: objects with ``id``, ``width`` and ``height``; ``tokens``: each edit's joint sequence length by id;
    ``element_size``: bytes per element of the widest dtype the run builds the model in; ``plan``: the layout plan
    (``sp_degree``, ``kind.batched_cfg``); ``ranks_here``: ranks sharing this machine's memory (counted on a CPU)."""
    largest = max(edits, key=lambda edit: tokens[edit.id])
    on_host = placement.device.type == "cpu"
    need = estimate(
        geometry,
        tokens[largest.id],
        largest.width * largest.height,
        element_size,
        element_size,
        parameter_count(geometry),
        ranks_per_sequence=plan.sp_degree,
        batch=2 if plan.kind.batched_cfg else 1,
        on_host=on_host,
    )
    check_fits(
        largest.id,
        f"{largest.width}x{largest.height}",
        tokens[largest.id],
        need,
        free_bytes(placement.device),
        placement.device,
        ranks_here if on_host else 1,
    )
