"""``ditrun warm``: every shape a workload needs compiled into the compile cache, as one job.

``ditrun warm key=value ...`` is the run of that config (``warm.enabled``: the same checks, launchers, ranks, model
and compile-cache entries, ``run/compile_cache.py``) with no edit in it. Its sizes are the workload's edits'
(one of each), or the output sizes ``warm.sizes`` and ``warm.preset`` name, each with the workload's first edit's
picture and prompt; sizes of equal token counts share a shape, and so an entry. Global rank 0 decides, from the
entries it loaded, which shapes still lack theirs; for each of those, every rank runs one denoising step (one guided
velocity: both CFG branches, the layout's exchanges), and rank 0 writes the shape's entry. CUDA graphs are not kept:
each process records its own. A later run of the same config finds the entry of each of its edits' shapes and
compiles none of them. Rank 0 says what it did, one line per size, and writes ``warm.json`` into the run's directory.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
from omegaconf import ListConfig

from ditrun.errors import UserError
from ditrun.model.compile import plan_compile
from ditrun.model.sampler import denoise
from ditrun.results import files
from ditrun.run import compile_cache
from ditrun.workload.edit import Edit
from ditrun.workload.images import KONTEXT_RESOLUTIONS, PATCH_PIXELS, REF_RESIZE
from ditrun.workload.inputs import edit_tokens

PRESETS = {"kontext": KONTEXT_RESOLUTIONS}
"""``warm.preset``: name -> output sizes (width, height)."""
WARM_FILE = "warm.json"
FILLED, THERE, UNWRITTEN = "filled", "already there", "not written"


def check_config(cfg, device: torch.device) -> None:
    """What ``ditrun warm`` cannot do with ``cfg``, one sentence naming the key, before any work; a run given
    ``warm.*`` keys without ``warm.enabled`` is refused too (it would ignore them)."""
    warm = cfg.warm
    if not warm.enabled:
        if warm.sizes or warm.preset:
            key = "warm.sizes" if warm.sizes else "warm.preset"
            raise UserError(f"{key} is read by ditrun warm only, and this run would ignore it; run ditrun warm.")
        return
    _check_sizes(warm)
    plan = plan_compile(cfg.model, device)
    if not plan.compile:
        raise UserError(
            f"model.compile={cfg.model.compile} compiles nothing on {device.type}, so ditrun warm has nothing to "
            "warm; set model.compile=on."
        )
    if plan.backend != "inductor":
        raise UserError(
            f"model.compile_backend={plan.backend!r} keeps no compiled code in the compile cache, so ditrun warm "
            "has nothing to keep; warm with model.compile_backend=inductor."
        )
    if compile_cache.cache_dir(cfg.model.compile_cache) is None:
        raise UserError(
            f"model.compile_cache={cfg.model.compile_cache} keeps no entries, so ditrun warm has nowhere to put what "
            "it compiles; name a folder (auto: the user's cache)."
        )


def _check_sizes(warm) -> None:
    if warm.preset is not None and warm.preset not in PRESETS:
        raise UserError(f"warm.preset={warm.preset!r} is unknown; allowed: {', '.join(PRESETS)}.")
    for index, size in enumerate(warm.sizes):
        values = list(size) if isinstance(size, ListConfig) else size
        if not isinstance(values, list) or len(values) not in (2, 4) or not all(type(v) is int for v in values):
            raise UserError(
                f"warm.sizes[{index}]={values} is not [width, height] or [width, height, ref_width, ref_height] in "
                "pixels; warm.sizes is a list of them, e.g. warm.sizes=[[1024,1024],[832,1248]]."
            )
        if any(value <= 0 or value % PATCH_PIXELS for value in values):
            raise UserError(
                f"warm.sizes[{index}]={values} has a size that is not a positive multiple of {PATCH_PIXELS} pixels "
                "(the model's patch grid)."
            )


def warm_edits(cfg, edits: Sequence[Edit]) -> list[Edit]:
    """One edit per size to warm: the workload's first edit of each size of ``edits``, or, where ``warm.sizes`` or
    ``warm.preset`` name sizes, the first edit at each of those sizes (its reference sized as the workload sizes
    an edit's, unless the size gives it)."""
    warm = cfg.warm
    sizes = [tuple(size) for size in PRESETS.get(warm.preset, ())] + [tuple(size) for size in warm.sizes]
    if sizes:
        first = edits[0]
        edits = [_at_size(first, size, cfg.workload, index) for index, size in enumerate(dict.fromkeys(sizes))]
    by_size = {}
    for edit in edits:
        size = (edit.width, edit.height, edit.ref_width, edit.ref_height, edit_tokens(edit, cfg.workload.text_len))
        by_size.setdefault(size, edit)
    return list(by_size.values())


def _at_size(edit: Edit, size: tuple, workload, index: int) -> Edit:
    width, height, *reference = size
    edit = dataclasses.replace(edit, index=index, id=f"warm{index:04d}", width=width, height=height)
    if not reference and workload.ref_width is not None:
        reference = [workload.ref_width, workload.ref_height]
    ref_width, ref_height = reference or REF_RESIZE[workload.ref_resize](edit)
    return dataclasses.replace(edit, ref_width=ref_width, ref_height=ref_height)


def run(state, job, stop_point: Callable[[], None]) -> Optional[dict]:
    """This rank's part of the warm job: ``state`` is its ``worker.Run`` of ``warm_edits``, ``stop_point`` raises the
    stop the job's ranks agree on, if any; returns what rank 0 wrote to ``warm.json``, None elsewhere."""
    rank0 = state.layout.rank == 0
    if rank0:
        folder = compile_cache.cache_dir(state.cfg.model.compile_cache)
        print(f"ditrun: warm: {len(state.edits)} size(s) into {folder}", flush=True)
    state.edits = state.encode_prompts(job)
    state.build(job)
    job.barrier("loaded")
    rows = _fill(state, job, stop_point, announce=rank0)
    job.barrier("warmed")
    if not rank0:
        return None
    result = {"sizes": rows, "compile_cache": state.compile_cache.fields()}
    files.write_json(state.out_dir / WARM_FILE, result)
    return result


def _fill(state, job, stop_point: Callable[[], None], announce: bool) -> list[dict]:
    """One step of the first size of each shape whose entry rank 0 did not load (every rank runs the same ones); one
    row per size: what the job did to its shape's entry."""
    cache, text_len = state.compile_cache, state.cfg.workload.text_len
    firsts = {compile_cache.shape_of(edit, text_len): edit for edit in reversed(state.edits)}
    todo = set(job.share("warm", lambda: [e.id for e in firsts.values() if cache.entry_of(e).status != "hit"]))
    done: dict[tuple, str] = {}  # shape -> what this job did to its entry
    rows = []
    for edit in state.edits:
        shape = compile_cache.shape_of(edit, text_len)
        entry = cache.entries[shape]
        if shape not in done and edit.id in todo:
            stop_point()
            written = entry.written
            _one_step(state, edit, job)
            done[shape] = FILLED if entry.written > written else UNWRITTEN
        done.setdefault(shape, THERE)
        rows.append({"size": size_label(edit), "shape": list(shape), "done": done[shape], "entry": str(entry.path)})
        if announce:
            print(f"ditrun: warm: {rows[-1]['size']} ({entry.label}): {done[shape]} ({entry.path})", flush=True)
    return rows


def size_label(edit: Edit) -> str:
    return f"{edit.width}x{edit.height} output, {edit.ref_width}x{edit.ref_height} reference"


def _one_step(state, edit: Edit, job) -> None:
    """One denoising step of ``edit`` on this rank, inside its compile-cache recording (rank 0 writes the entry)."""
    inputs = state.inputs(edit)
    _, velocity = state.velocity(inputs)
    job.beat(f"warming {edit.width}x{edit.height}")
    with torch.inference_mode(), state.compile_cache.recording(edit):
        denoise(velocity, inputs.noise, 1)
