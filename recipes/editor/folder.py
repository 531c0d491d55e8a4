"""The editor's pipeline folder: the parts besides the DiT, built offline, and the folder's layout.

The folder is a diffusers ``FluxKontextPipeline`` folder (``model_index.json``, ``transformer/``,
``vae/``, ``text_encoder/`` (CLIP), ``text_encoder_2/`` (T5), ``tokenizer/``, ``tokenizer_2/``,
``scheduler/``), so ``FluxKontextPipeline.from_pretrained`` and ``ditrun model.path=...`` both load it.
The text encoders are small, randomly initialised from a seed and frozen: the DiT learns what their
outputs mean. Their tokenizers are built here from the instructions' own words (no download):
CLIP's is byte-level BPE with no merges (one token per character, as CLIP's own tokenizer falls back
to for unknown words), T5's a Unigram vocabulary of the instructions' words and every printable
ASCII character, so any prompt still tokenizes.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import torch

from ditrun.editor.transforms import prompts

CLIP_MAX_LENGTH = 77
# Widths: the DiT's pooled_projection_dim (CLIP) and joint_attention_dim (T5).
CLIP_WIDTH = 64
T5_WIDTH = 64
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
MODEL_INDEX = {
    "_class_name": "FluxKontextPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE: printable bytes as themselves, the rest shifted past 255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    shifted = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(shifted))]


def clip_tokenizer():
    from transformers import CLIPTokenizer

    base = _byte_alphabet()
    vocab = {token: i for i, token in enumerate(base + [c + "</w>" for c in base])}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = CLIP_MAX_LENGTH
    return tokenizer


def t5_tokenizer():
    from transformers import T5TokenizerFast

    words = sorted({w for p in prompts() for w in p.split()})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in words]
    pieces += [(c, -10.0) for c in string.printable.strip() if ("▁" + c, -1.0) not in pieces]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def text_encoders(seed: int):
    """(CLIP, T5) encoders for the tokenizers above, randomly initialised from ``seed``, frozen."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=CLIP_WIDTH,
            intermediate_size=2 * CLIP_WIDTH,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=CLIP_MAX_LENGTH,
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
            projection_dim=CLIP_WIDTH,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok),
            d_model=T5_WIDTH,
            d_kv=16,
            d_ff=2 * T5_WIDTH,
            num_layers=2,
            num_heads=4,
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=0,
        )
    )
    return clip.eval().requires_grad_(False), t5.eval().requires_grad_(False)


def write_text_parts(folder: Path, seed: int, text_len: int) -> None:
    """Tokenizers, text encoders (fp16), scheduler and ``model_index.json`` into ``folder``. ``text_len``, the T5
    tokens per prompt the DiT is trained with, is saved as the T5 tokenizer's ``model_max_length``: where a run
    reads the folder's text length (``model.folders.model_text_len``)."""
    folder.mkdir(parents=True, exist_ok=True)
    clip, t5 = text_encoders(seed)
    clip_tokenizer().save_pretrained(folder / "tokenizer")
    t5_tok = t5_tokenizer()
    t5_tok.model_max_length = text_len
    t5_tok.save_pretrained(folder / "tokenizer_2")
    clip.half().save_pretrained(folder / "text_encoder")
    t5.half().save_pretrained(folder / "text_encoder_2")
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=2) + "\n")
    (folder / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")


TEXT_PARTS = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "scheduler")


def copy_text_parts(source: Path, folder: Path) -> None:
    """The text parts, scheduler and ``model_index.json`` of a folder this recipe wrote, copied into ``folder``:
    a training that goes on from it keeps the text encoders its DiT learned."""
    folder.mkdir(parents=True, exist_ok=True)
    for part in TEXT_PARTS:
        shutil.copytree(source / part, folder / part, dirs_exist_ok=True)
    shutil.copy2(source / "model_index.json", folder / "model_index.json")
