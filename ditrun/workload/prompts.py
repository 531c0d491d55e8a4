"""Prompts encoded by the text encoders of a diffusers pipeline folder, once, cached on disk.

When ``model.path`` names a whole diffusers FLUX.1 (Kontext) pipeline folder (``model/folders.py``), each edit's
prompt is encoded by diffusers' own ``encode_prompt`` with ``max_sequence_length = workload.text_len`` (the
folder's when unset): one rank (global rank 0) loads the encoders, encodes every distinct prompt not yet in the
cache (and ``""``, the negative prompt of true CFG), frees them, and sends the files to the other ranks, which may
sit on other nodes without a shared file system. The DiT is built after that, so the encoders and the DiT are never
in memory together.

The cache (``$XDG_CACHE_HOME/ditrun/prompts``) holds one safetensors file per (folder, prompt,
lengths), with the tensor names of an embeddings file (``prompt_embeds``, ...), so every later
stage treats an encoded prompt as an edit whose ``prompt_embeds`` file was given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from ditrun.errors import UserError
from ditrun.model.folders import ENCODER_PARTS, is_pipeline_folder
from ditrun.results.files import is_node_fault
from ditrun.user_cache import user_cache_dir

# Bump when what is stored under a key changes.
PROMPT_FORMAT = 1


# The negative prompt of true CFG, as diffusers' negative_prompt="".
NEGATIVE_PROMPT = ""


def _check_encoders(folder: Path) -> None:
    missing = [part for part in ENCODER_PARTS if not (folder / part).is_dir()]
    if missing:
        parts = ", ".join(f"{part}/" for part in missing)
        raise UserError(
            f"model.path={str(folder)!r} is a pipeline folder without {parts}; "
            "give every edit a prompt_embeds file, or use a folder with both text encoders and tokenizers."
        )


def _encoder_fingerprint(folder: Path) -> list:
    """What decides an encoding: the encoders' and tokenizers' files (names, sizes, mtimes)."""
    return sorted(
        [str(f.relative_to(folder)), f.stat().st_size, f.stat().st_mtime_ns]
        for part in ENCODER_PARTS
        for f in (folder / part).rglob("*")
        if f.is_file()
    )


@dataclasses.dataclass
class PromptCache:
    """Where each prompt's embeddings file of one pipeline folder lives.

    A cache the disk refuses mid-run (full, no longer writable) moves to ``fallback`` (the run directory's, set by
    the run) with one warning: the encoded prompts reach the model, and every rank, as files, so they must be
    written somewhere; where the fallback cannot be written either, the error stands (the run ends as a stop does).
    """

    folder: Path
    max_sequence_length: int
    root: Path
    fallback: Optional[Path] = None
    moved: Optional[Path] = None  # ``fallback``, once ``root`` refused a file

    def __post_init__(self):
        self._fingerprint = _encoder_fingerprint(self.folder)

    def file(self, prompt: str) -> Path:
        return self.place(self.name(prompt))

    def place(self, name: str) -> Path:
        """Where the cache's file ``name`` is (``root``, or where it moved), or is to be written."""
        if self.moved is not None and not (self.root / name).is_file():
            return self.moved / name
        return self.root / name

    def name(self, prompt: str) -> str:
        key = json.dumps(
            {
                "format": PROMPT_FORMAT,
                "folder": str(self.folder.resolve()),
                "encoders": self._fingerprint,
                "prompt": prompt,
                "max_sequence_length": self.max_sequence_length,
            }
        )
        return f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"

    def missing(self, prompts: list[str]) -> list[str]:
        return [p for p in dict.fromkeys(prompts) if not self.file(p).is_file()]

    def store(self, prompt: str, data: bytes) -> Path:
        return self.write(self.name(prompt), data)

    def write(self, name: str, data: bytes) -> Path:
        """The cache's file ``name``, written atomically (one rename), so a reader never sees half a file; where it
        landed."""
        try:
            return _write_atomically(self.place(name), data)
        except OSError as err:
            if self.moved is not None or self.fallback is None or not is_node_fault(err):
                raise
            self.moved = self.fallback
            print(
                f"ditrun: warning: the prompt cache {self.root} cannot be written ({err.strerror or err}); this run "
                f"keeps its encoded prompts in {self.moved} (free space there, or set workload.prompt_cache_dir to a "
                "folder with room)",
                file=sys.stderr,
                flush=True,
            )
            return _write_atomically(self.moved / name, data)


def _write_atomically(path: Path, data: bytes) -> Path:
    """``data`` as ``path`` (a private temporary renamed into place); an error names ``path``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".prompt.", dir=path.parent)
    except OSError as err:
        raise OSError(err.errno, f"{err.strerror}: {path}") from err
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)  # a full disk: its space back
        raise OSError(err.errno, f"{err.strerror}: {path}") from err
    return path


def _library_bars_on_a_terminal_only() -> None:
    """diffusers' and transformers' bars (the pipeline loading its parts) redraw with carriage returns: off a
    terminal they are turned off for this process, as ditrun's own are (``metrics/progress.py``)."""
    if sys.stderr.isatty():
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def encode(cache: PromptCache, prompts: list[str], device: torch.device, dtype: torch.dtype) -> None:
    """Encode ``prompts`` with the folder's CLIP and T5 through diffusers' ``encode_prompt``; the
    encoders are freed before this returns."""
    from diffusers import FluxPipeline
    from safetensors.torch import save

    _library_bars_on_a_terminal_only()
    # ditrun says which prompts are cut, edit by edit (``warn_truncated``); diffusers' own lines would repeat it.
    logging.getLogger("diffusers.pipelines.flux.pipeline_flux").setLevel(logging.ERROR)
    pipe = FluxPipeline.from_pretrained(
        cache.folder, transformer=None, vae=None, torch_dtype=dtype, low_cpu_mem_usage=False
    ).to(device)
    with torch.no_grad():
        for prompt in prompts:
            embeds, pooled, _ = pipe.encode_prompt(
                prompt=prompt, prompt_2=None, device=device, max_sequence_length=cache.max_sequence_length
            )
            cache.store(
                prompt,
                save(
                    {
                        "prompt_embeds": embeds[0].float().cpu().contiguous(),
                        "pooled_prompt_embeds": pooled[0].float().cpu().contiguous(),
                    }
                ),
            )
    del pipe
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _share(cache: PromptCache, prompts: list[str], control) -> None:
    """Rank 0's files to every rank whose cache lacks them (a gloo group over the world)."""
    import torch.distributed as dist

    wanted = [None]
    if dist.get_rank() == 0:
        wanted = [{p: cache.file(p).read_bytes() for p in dict.fromkeys(prompts)}]
    dist.broadcast_object_list(wanted, src=0, group=control)
    for prompt, data in wanted[0].items():
        if not cache.file(prompt).is_file():
            cache.store(prompt, data)


def _edit_file(cache: PromptCache, prompt: str, true_cfg: bool) -> Path:
    """The embeddings file of one edit: the prompt's tensors, with the empty prompt's as the negative."""
    from safetensors.torch import load_file, save

    if not true_cfg:
        return cache.file(prompt)
    combined = cache.place(cache.name(prompt).replace(".safetensors", ".cfg.safetensors"))
    if not combined.is_file():
        tensors, negative = load_file(cache.file(prompt)), load_file(cache.file(NEGATIVE_PROMPT))
        tensors.update(
            negative_prompt_embeds=negative["prompt_embeds"],
            negative_pooled_prompt_embeds=negative["pooled_prompt_embeds"],
        )
        combined = cache.write(combined.name, save(tensors))
    return combined


def prompt_cache(edits: list, cfg, fallback: Optional[Path] = None) -> Optional[PromptCache]:
    """Where the encoded prompts of ``edits`` live, or None when there is nothing to encode (no pipeline
    folder, or every edit names its own embeddings file); ``fallback``: where they go if that disk refuses them."""
    if not is_pipeline_folder(cfg.model.path) or all(e.prompt_embeds for e in edits):
        return None
    _check_encoders(Path(cfg.model.path))
    return PromptCache(
        Path(cfg.model.path),
        cfg.workload.text_len,
        Path(cfg.workload.prompt_cache_dir) if cfg.workload.prompt_cache_dir else user_cache_dir() / "prompts",
        fallback,
    )


def _prompts(edits: list, cfg) -> list[str]:
    return [e.prompt for e in edits if not e.prompt_embeds] + (
        [NEGATIVE_PROMPT] if cfg.workload.true_cfg_scale > 1 else []
    )


def encode_missing(cache: PromptCache, edits: list, cfg, device: torch.device, dtype: torch.dtype) -> None:
    """Encode the prompts of ``edits`` that ``cache`` lacks (global rank 0's work, alone), after saying which the
    encoders cut (``warn_truncated``: on every run, cached or not)."""
    warn_truncated(cache, [e for e in edits if not e.prompt_embeds])
    missing = cache.missing(_prompts(edits, cfg))
    if missing:
        print(
            f"ditrun: encoding {len(missing)} prompts with the text encoders of {cache.folder} at "
            f"{cache.max_sequence_length} tokens ({cfg.workload.text_len_from}), cached in {cache.root}",
            flush=True,
        )
        encode(cache, missing, device, dtype)


def warn_truncated(cache: PromptCache, edits: list) -> None:
    """One warning line per edit whose prompt a text encoder cuts: CLIP at its tokenizer's length, T5 at
    ``workload.text_len`` (as diffusers' ``encode_prompt`` does). Only the tokenizers are loaded, so every run that
    uses the prompt says it, not only the one that encodes it."""
    from transformers import AutoTokenizer

    encoders = {
        "CLIP": AutoTokenizer.from_pretrained(cache.folder / "tokenizer"),
        "T5": AutoTokenizer.from_pretrained(cache.folder / "tokenizer_2"),
    }
    kept = {"CLIP": encoders["CLIP"].model_max_length, "T5": cache.max_sequence_length}
    for edit in edits:
        lengths = {name: len(tokenizer(edit.prompt, verbose=False).input_ids) for name, tokenizer in encoders.items()}
        cut = [f"{name} keeps {kept[name]} of its {n} tokens" for name, n in lengths.items() if n > kept[name]]
        if cut:
            print(
                f"ditrun: warning: edit {edit.id!r}: its prompt is cut short ({'; '.join(cut)}; T5's length is "
                "workload.text_len): the model never sees the rest",
                file=sys.stderr,
                flush=True,
            )


def with_embeddings(cache: PromptCache, edits: list, cfg, control) -> list:
    """``edits`` with each prompt's embeddings file filled in (edits that name their own file keep it), once
    rank 0 has encoded them; ``control`` (a gloo group over the world, or None in a one-process run) carries
    the files to the other ranks."""
    if control is not None:
        _share(cache, _prompts(edits, cfg), control)
    true_cfg = cfg.workload.true_cfg_scale > 1
    return [
        e if e.prompt_embeds else dataclasses.replace(e, prompt_embeds=str(_edit_file(cache, e.prompt, true_cfg)))
        for e in edits
    ]
