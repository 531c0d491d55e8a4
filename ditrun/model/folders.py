"""The parts of a diffusers pipeline folder a run reads, and the prompt length its DiT was trained with.

``model.path`` may name a whole diffusers FLUX.1 (Kontext) pipeline folder (``model_index.json``,
``transformer/``, ``vae/``, ``text_encoder/`` (CLIP), ``text_encoder_2/`` (T5), ``tokenizer/``,
``tokenizer_2/``). Then the DiT comes from ``transformer/``, the VAE from ``vae/`` (unless
``workload.vae_path`` names another), and the prompts are encoded by its text encoders
(``workload/prompts.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def is_pipeline_folder(path: Optional[str]) -> bool:
    """A diffusers pipeline folder: ``model_index.json`` beside a ``transformer/`` folder."""
    return bool(path) and (Path(path) / "model_index.json").is_file() and (Path(path) / "transformer").is_dir()


def transformer_folder(path: str) -> str:
    """The DiT's folder: ``<pipeline>/transformer`` for a pipeline folder, else ``path`` itself."""
    return str(Path(path) / "transformer") if is_pipeline_folder(path) else path


def vae_folder(model_path: Optional[str], vae_path: Optional[str]) -> Optional[str]:
    """``workload.vae_path`` when set, else a pipeline folder's ``vae/``, else None (the linear map)."""
    if vae_path or not is_pipeline_folder(model_path):
        return vae_path
    return str(Path(model_path) / "vae")


ENCODER_PARTS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")


ENCODERS = ("text_encoder", "text_encoder_2")


def check_components(model_path: Optional[str], vae_path: Optional[str]) -> None:
    """The components a run reads besides the DiT (whose folder ``load.checkpoint_geometry`` checks), from their
    files' headers, before any work: the VAE (``workload.vae_path``, or a pipeline folder's ``vae/``) and a
    pipeline folder's text encoders."""
    from ditrun.model.load import check_component

    vae = vae_folder(model_path, vae_path)
    if vae is not None:
        check_component(Path(vae), "workload.vae_path" if vae_path else "model.path's vae/")
    if is_pipeline_folder(model_path):
        for part in ENCODERS:
            if (Path(model_path) / part).is_dir():  # a missing one is said when prompts need it (_check_encoders)
                check_component(Path(model_path) / part, f"model.path's {part}/")


DIFFUSERS_TEXT_LEN = 512
"""diffusers' ``FluxPipeline`` / ``FluxKontextPipeline`` ``max_sequence_length`` default (and the most they take)."""


STANDIN_TEXT_LEN = 32
"""Tokens of a stand-in prompt embedding (no text encoder)."""


def model_text_len(model_path: Optional[str]) -> tuple[int, str]:
    """(T5 tokens per prompt, where that comes from) of the model at ``model_path``. A pipeline folder's T5
    tokenizer's ``model_max_length``, where it is at most 512, is the length the folder's DiT was trained with (FLUX.1
    folders say 512; ``python -m recipes.editor.train`` writes its ``text_len`` there); else diffusers' default. A
    model without text encoders takes stand-in prompts of ``STANDIN_TEXT_LEN``."""
    if not is_pipeline_folder(model_path):
        return STANDIN_TEXT_LEN, "the stand-in prompt length (no pipeline folder encodes the prompts)"
    config = Path(model_path) / "tokenizer_2" / "tokenizer_config.json"
    try:
        length = json.loads(config.read_text()).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        length = None
    if isinstance(length, int) and 1 <= length <= DIFFUSERS_TEXT_LEN:
        return length, f"{config} (model_max_length)"
    return DIFFUSERS_TEXT_LEN, "diffusers' max_sequence_length default"
