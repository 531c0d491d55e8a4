"""Which edits a workload runs: inline (``workload.edits``) or from a YAML/JSONL manifest (``workload.manifest``),
with defaults filled in from ``workload.*`` and every field checked, before any model is built."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Optional

import yaml

from ditrun.model.folders import model_text_len
from ditrun.workload.edit import Edit, WorkloadError
from ditrun.workload.images import PATCH_PIXELS, REF_RESIZE, not_regular

_EDIT_KEYS = ("id", "image", "prompt", "prompt_embeds", "seed", "width", "height", "ref_width", "ref_height", "target")


# An edit id names its output files, so it must be a plain file stem: nothing that could climb
# out of the results directory, make a sub-folder or hide a file.
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# torch.Generator.manual_seed takes 0 .. 2**64 - 1 (a negative seed would alias a large one).
SEED_LIMIT = 2**64


MAX_MANIFEST_BYTES = 64 * 2**20
"""The largest manifest read (about a million edits): a bound, so that a device (``/dev/zero``) or a wrong file
cannot fill the memory."""


def _read_manifest(path: str) -> list[dict]:
    file = Path(path)
    if file.exists() and not file.is_file():  # stat only: opening a FIFO would wait for a writer
        raise WorkloadError(f"workload.manifest={path!r} is {not_regular(file)}; give a YAML or JSONL file.")
    try:
        size = file.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise WorkloadError(
                f"workload.manifest={path!r} is {size / 2**20:.0f} MiB; a manifest is at most "
                f"{MAX_MANIFEST_BYTES // 2**20} MiB."
            )
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
                except RecursionError:
                    raise WorkloadError(f"{path} line {n} nests too deeply to be an edit.") from None
        return entries
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise WorkloadError(f"workload.manifest={path!r} is not valid YAML: {err}.")
    except RecursionError:
        raise WorkloadError(f"workload.manifest={path!r} nests too deeply to be a list of edits.") from None
    data = data.get("edits") if isinstance(data, dict) else data
    if not isinstance(data, list):
        raise WorkloadError(f"workload.manifest={path!r} must be a list of edits (or a mapping with 'edits:').")
    return data


def resolve_text_len(cfg) -> None:
    """``workload.text_len`` the user's, or the model's when unset (``model.folders.model_text_len``), with
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
    ``testing.fault`` is checked against ``workload.steps``)."""
    limit, steps, text_len = workload_cfg.limit, workload_cfg.steps, workload_cfg.text_len
    if limit is not None and limit < 1:
        raise WorkloadError(f"workload.limit={limit} must be a positive number of edits, or unset for all of them.")
    if steps < 1:
        raise WorkloadError(f"workload.steps={steps} must be at least 1.")
    if text_len is not None and text_len < 1:
        raise WorkloadError(f"workload.text_len={text_len} must be a positive number of stand-in prompt tokens.")
    if workload_cfg.ref_resize not in REF_RESIZE:
        raise WorkloadError(
            f"workload.ref_resize={workload_cfg.ref_resize!r} is not a reference size rule; allowed: "
            f"{', '.join(REF_RESIZE)}."
        )
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
    """The id of the workload's entry ``index`` as declared: its ``id``, else ``edit<index>``. An id that is not a
    string is refused: YAML reads an unquoted ``010`` as the number 8 and ``on`` as true, which would name files."""
    if not isinstance(entry, dict) or entry.get("id") is None:
        return f"edit{index:04d}"
    value = entry["id"]
    if not isinstance(value, str):
        raise WorkloadError(
            f"workload edit #{index} has id {value!r}, a {type(value).__name__}, not a string (YAML reads an "
            "unquoted 010 as the number 8, and on, yes, no as booleans); quote the id in the manifest, e.g. "
            'id: "010".'
        )
    return value or f"edit{index:04d}"


def _check_unique_ids(raw: list) -> None:
    """Ids are unique over the whole workload, ``workload.limit`` or not: they name output files, and a results
    directory records every declared edit by id (a later entry would replace an earlier one there)."""
    first: dict[str, int] = {}
    for index, entry in enumerate(raw):
        name = declared_id(index, entry)
        if name in first:
            raise WorkloadError(
                f"edit id {name!r} appears twice in the workload (entries {first[name]} and {index}, "
                "counting from 0); ids name output files."
            )
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
        raise WorkloadError(
            f"edit {name!r} names no image (key 'image': skimage:<name>, matplotlib:<file>, sklearn:<file> or a "
            "file path)."
        )
    defaults = {
        "seed": workload_cfg.seed + index,
        "width": workload_cfg.width,
        "height": workload_cfg.height,
        "ref_width": workload_cfg.ref_width,
        "ref_height": workload_cfg.ref_height,
    }
    numbers = {key: _int_field(name, entry, key, default) for key, default in defaults.items()}
    for key in ("width", "height", "ref_width", "ref_height"):
        value = numbers[key]
        if value is not None and (value <= 0 or value % PATCH_PIXELS):
            source = "" if entry.get(key) is not None else f" (workload.{key})"
            raise WorkloadError(f"edit {name!r} has {key}={value}{source}; it must be a positive multiple of 16.")
    if (numbers["ref_width"] is None) != (numbers["ref_height"] is None):
        raise WorkloadError(
            f"edit {name!r} sets only one of ref_width and ref_height; set both, or neither to let "
            f"workload.ref_resize={workload_cfg.ref_resize!r} decide."
        )
    edit = Edit(
        index=index,
        id=str(name),
        image=str(entry["image"]),
        prompt=str(entry.get("prompt") or ""),
        prompt_embeds=entry.get("prompt_embeds"),
        target=_target(name, entry.get("target")),
        **numbers,
    )
    _check_seed(f"edit {edit.id!r}: seed", edit.seed)
    if edit.ref_width is None:
        ref_width, ref_height = REF_RESIZE[workload_cfg.ref_resize](edit)
        edit = dataclasses.replace(edit, ref_width=ref_width, ref_height=ref_height)
    return edit


def _target(name: str, target) -> Optional[str]:
    """An edit's ``target``: a known edit's name, or an image file (checked from its header later)."""
    from ditrun.editor.transforms import EDITS

    if target is None or str(target) in EDITS:
        return None if target is None else str(target)
    if not isinstance(target, str) or not Path(target).exists():
        raise WorkloadError(
            f"edit {name!r} has target={target!r}; allowed: an edit name ({EDITS.allowed()}) or an "
            "image file of the correct result."
        )
    return target


def _int_field(name: str, entry: dict, key: str, default: int) -> int:
    value = entry.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"edit {name!r} has {key}={value!r}; it must be an integer.")
    return value
