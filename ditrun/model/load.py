"""Building a DiT: from a diffusers-format folder, or with seeded random weights.

The load path reads top to bottom: geometry from ``config.json`` -> module on the ``meta``
device (no memory) -> every tensor checked against the module's names and shapes -> tensors
read from safetensors straight onto the target device in the target dtype -> assigned in place.
A 12B checkpoint is therefore never materialised twice. Only safetensors is read; nothing is
unpickled.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ditrun.errors import UserError
from ditrun.model.dit import DiTGeometry, FluxDiT
from ditrun.model.presets import check_geometry_numbers

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
_GEOMETRY_KEYS = {f.name for f in dataclasses.fields(DiTGeometry)}


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded; the message is one sentence naming the file or key."""


def geometry_from_json(path: Path) -> DiTGeometry:
    """Read a diffusers ``config.json``; keys that are not part of the geometry are ignored."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: a model folder needs config.json beside its safetensors.")
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}).")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object of model settings.")
    fields = {k: v for k, v in raw.items() if k in _GEOMETRY_KEYS}
    check_geometry_numbers(fields, f"{path}: ")
    if "axes_dims_rope" in fields:
        fields["axes_dims_rope"] = tuple(fields["axes_dims_rope"])
    try:
        return DiTGeometry(**fields)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path} describes an unsupported geometry: {err}")


def checkpoint_geometry(path: str | Path) -> DiTGeometry:
    """The geometry of a diffusers-format folder, read without touching the weights (the weight
    index or the safetensors headers are checked too, so a broken folder fails before any work)."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model.path={str(path)!r} is not a folder with config.json and *.safetensors.")
    geometry = geometry_from_json(folder / CONFIG_NAME)
    _weight_files(folder)
    return geometry


def check_component(folder: Path, where: str) -> None:
    """A diffusers component folder (a VAE, a text encoder) that a run reads, from its files alone: ``config.json``
    present and every ``*.safetensors`` file's header complete (a truncated copy fails here, before any work,
    rather than while the component loads). ``where`` names the folder in the sentence (the key or the part)."""
    if not folder.is_dir():
        raise CheckpointError(f"{where} {str(folder)!r} is not a folder with config.json and *.safetensors.")
    if not (folder / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"{where}: {folder / CONFIG_NAME} is missing: a model folder needs config.json beside its weights."
        )
    for file in sorted(folder.glob("*.safetensors")):
        with _open(file):
            pass


def _weight_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it (sharded or single-file checkpoints)."""
    index = folder / INDEX_NAME
    if index.exists():
        return _read_index(index)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors weights (only safetensors is read, never pickles).")
    names = {}
    for file in files:
        with _open(file) as f:
            names.update({name: file for name in f.keys()})
    return names


def _read_index(index: Path) -> dict[str, Path]:
    """A sharded checkpoint's ``{"weight_map": {tensor name: file in the folder}}``, every file present."""
    try:
        raw = json.loads(index.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{index} is not valid JSON ({err}).")
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f'{index} has no "weight_map" object of tensor name -> safetensors file.')
    files = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise CheckpointError(
                f"{index} maps {name!r} to {file!r}; allowed: a *.safetensors file name in {index.parent}."
            )
        if not (index.parent / file).is_file():
            raise CheckpointError(f"{index} maps {name!r} to {file}, which is not in {index.parent}.")
        files[name] = index.parent / file
    return files


def _open(file: Path, device: str = "cpu"):
    try:
        return safe_open(str(file), framework="pt", device=device)
    except FileNotFoundError:
        raise CheckpointError(f"weights file {file} is missing.")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"weights file {file} is unreadable (truncated or not safetensors): {err}.")


def _check_names_and_shapes(model: torch.nn.Module, files: dict[str, Path]) -> None:
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(set(expected) - set(files))
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r} ({len(missing)} missing in all).")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has tensor {unexpected[0]!r} that this model does not ({len(unexpected)} such in all); "
            "is config.json the one written with these weights?"
        )
    for file in sorted(set(files.values())):
        with _open(file) as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"tensor {name!r} in {file.name} has shape {shape}, the model expects {expected[name]}."
                    )


def _read_tensors(files: dict[str, Path], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    state = {}
    for file, names in by_file.items():
        with _open(file, device=str(device)) as f:
            for name in names:
                try:
                    state[name] = f.get_tensor(name).to(dtype)
                except (SafetensorError, OSError, RuntimeError) as err:
                    raise CheckpointError(f"tensor {name!r} in {file} is unreadable (truncated file?): {err}.")
    return state


def load_pretrained_weights(model: torch.nn.Module, path: str | Path, dtype: torch.dtype, device: torch.device) -> None:
    """Fill a ``meta`` model (a DiT, an autoencoder) from a diffusers-format folder, each tensor read straight onto
    ``device`` in ``dtype``."""
    files = _weight_files(Path(path))
    _check_names_and_shapes(model, files)
    model.load_state_dict(_read_tensors(files, torch.device(device), dtype), strict=True, assign=True)


def from_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> FluxDiT:
    """Load a diffusers-format transformer folder (``FluxTransformer2DModel.save_pretrained``)."""
    with torch.device("meta"):
        model = FluxDiT(checkpoint_geometry(path))
    load_pretrained_weights(model, path, dtype, torch.device(device))
    return model.eval().requires_grad_(False)


def random_model(
    geometry: DiTGeometry, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> FluxDiT:
    """A model with seeded random weights: the same seed gives the same weights on every rank."""
    with torch.device("meta"):
        model = FluxDiT(geometry)
    draw_random_weights(model, seed, dtype, torch.device(device))
    return model.eval().requires_grad_(False)


def draw_random_weights(model: FluxDiT, seed: int, dtype: torch.dtype, device: torch.device) -> None:
    """Fill a ``meta`` model with seeded random weights on ``device`` in ``dtype``.

    Weights are drawn in fp32 on the target device, tensor by tensor in name order, then cast.
    Linear weights are uniform in +-1/sqrt(fan_in) (PyTorch's default scale); biases and norm
    weights are drawn around their neutral values so that no code path is trivially zero.
    The tensors are assigned as a checkpoint's are (``load_state_dict(assign=True)``): nothing is allocated to
    be overwritten, and ``Module.to_empty`` (whose Python ``empty_like`` imports sympy, 0.75 s of every process
    and rank that builds a model) is not needed.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, param in sorted(model.named_parameters()):
        data = torch.empty(param.shape, dtype=torch.float32, device=device)
        if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or ".norm_added_" in name:
            data.uniform_(0.9, 1.1, generator=gen)
        else:
            bound = 1.0 / (param.shape[-1] ** 0.5) if param.ndim == 2 else 0.02
            data.uniform_(-bound, bound, generator=gen)
        state[name] = data.to(dtype)
    model.load_state_dict(state, strict=True, assign=True)


def save_pretrained(model: FluxDiT, path: str | Path, max_shard_bytes: Optional[int] = None) -> None:
    """Write a diffusers-format folder (config.json + safetensors, sharded past ``max_shard_bytes``)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"_class_name": "FluxTransformer2DModel", **dataclasses.asdict(model.geometry)}
    config["axes_dims_rope"] = list(config["axes_dims_rope"])
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    shards = _shard(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS_NAME))
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file))
        weight_map.update({name: file for name in shard})
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _shard(state: dict[str, torch.Tensor], max_bytes: Optional[int]) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards
