"""The editor's training settings: one dataclass that defines the result, and the check of every value.

``TrainConfig``'s defaults are the first training's, from the seed; the committed folder (ditrun/editor/pipeline)
went on from there in nine more trainings, each with ``--init`` and the options docs/EDITOR.md ("Repeating its
training") lists and its ``train.json`` records. ``problems`` returns one sentence per wrong value, so the script can
refuse before any work; the command-line options are derived from the fields, so no option is written twice.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch

from recipes.editor import pictures

VAE_LOSSES = ("l1+mse", "l1+ssim", "l1+gradient")
"""The VAE's reconstruction losses: L1 plus ``vae_loss_weight`` times MSE, (1 - SSIM) or the L1 of the image
gradients; each plus ``vae_kl`` times the KL term."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting that changes the trained folder (recorded in train.json, checked again on ``--resume``)."""

    seed: int = 0
    """Everything random (data, initial weights, noise) is drawn from generators seeded from it."""
    init: str = ""
    """A pipeline folder this recipe wrote, to go on training from ('': start from the seed's random weights). Its
    text encoders, tokenizers and the VAE's encoder and latent statistics are kept, so that its latents, and a DiT
    trained on them, stay valid: the VAE phase trains only the decoder (``vae_steps``, 0: none). Its DiT starts the
    DiT phase (the model and the EMA; AdamW and the learning-rate schedule start anew)."""
    size: int = 256
    """Pixel size of the DiT's training edits (square), a multiple of 16 (8x VAE, then 2x2 patches)."""
    train_pictures: tuple = pictures.TRAIN
    """Pictures the VAE and the DiT train on (``package:name``, recipes/editor/pictures.py)."""
    eval_pictures: tuple = pictures.HELD_OUT
    """Held-out pictures the evaluation measures on."""
    vae_steps: int = 10000
    vae_batch: int = 32
    vae_crop: int = 128
    """Pixel size of the VAE's training crops, a multiple of 8."""
    vae_lr: float = 1e-3
    vae_kl: float = 1e-6
    vae_widths: tuple = (48, 96, 176, 176)
    """Channels of the VAE's four blocks (8x: three downsamplings), each a multiple of ``vae_norm_groups``."""
    vae_layers: int = 1
    """ResNet layers per block of the VAE's encoder (its decoder has one more, as diffusers builds it)."""
    vae_norm_groups: int = 16
    vae_loss: str = "l1+mse"
    """One of ``VAE_LOSSES``."""
    vae_loss_weight: float = 4.0
    """Weight of the loss's second term (MSE, 1 - SSIM or gradient L1) against L1."""
    dead_leaves: float = 0.5
    """Fraction of each VAE batch that is synthetic dead-leaves pictures (discs of radii drawn from r^-3, colours
    of training pixels) rather than crops: more varied pictures than the training set holds."""
    grey_untinted: float = 0.0
    """Fraction of the grey training pictures' crops (VAE and DiT alike) left grey, R = G = B, as the held-out camera
    and coins are; the others are tinted by a random colour (0: every grey crop tinted, as the committed folder's
    first four trainings drew them; its fifth to seventh, ninth and tenth left 0.3 grey)."""
    vae_edited: float = 0.0
    """Fraction of each VAE batch's pictures (crops and dead leaves alike) replaced by one of the known edits of
    themselves, drawn at random: the kind of picture the VAE decodes from the DiT's outputs (posterized, pixelated,
    mirrored ...)."""
    dit_steps: int = 4500
    """Length of the DiT's learning-rate schedule (0: train only the VAE)."""
    dit_batch: int = 256
    dit_lr: float = 1e-3
    warmup: int = 200
    pool: int = 8192
    """Reference crops encoded once, with every edit of each (the DiT's training set)."""
    dit_stop_after: int = 0
    """Stop the DiT after this many steps (0: at ``dit_steps``), the schedule still that of ``dit_steps``."""
    edit_weights: str = ""
    """How often each edit is drawn, for the DiT's batches and the VAE's edited pictures (``vae_edited``),
    ``name=weight,...`` against 1 for every edit not named ('': every edit equally often, drawn uniformly as the
    first training did): e.g. ``posterize=4``."""
    prompt_dropout: float = 0.1
    ema: float = 0.995
    text_len: int = 32
    """T5 tokens per prompt (``workload.text_len`` of the runs that use the editor)."""
    eval_steps: int = 8
    eval_cfg_scales: tuple = (1.0, 2.5)
    eval_every: int = 2000
    """Measure the model on the held-out pictures every this many steps of each phase (0: only at the end)."""
    log_every: int = 50

    @property
    def dit_last_step(self) -> int:
        return self.dit_stop_after or self.dit_steps


def _positive(cfg: TrainConfig, *names: str) -> list[str]:
    return [f"--{_option(n)} {getattr(cfg, n)}: must be at least 1." for n in names if getattr(cfg, n) < 1]


def _not_negative(cfg: TrainConfig, *names: str) -> list[str]:
    return [f"--{_option(n)} {getattr(cfg, n)}: must not be negative." for n in names if getattr(cfg, n) < 0]


def _fraction(cfg: TrainConfig, name: str, top: float) -> list[str]:
    value = getattr(cfg, name)
    inside = 0 <= value < top if top < 1 else 0 <= value <= top
    bound = "below 1" if top < 1 else "at most 1"
    return [] if inside else [f"--{_option(name)} {value}: must be between 0 and 1 ({bound})."]


def _geometry(cfg: TrainConfig) -> list[str]:
    out = []
    if cfg.size < 16 or cfg.size % 16:
        out.append(f"--size {cfg.size}: must be a positive multiple of 16 (the VAE divides by 8, then 2x2 patches).")
    if cfg.vae_crop < 8 or cfg.vae_crop % 8:
        out.append(f"--vae-crop {cfg.vae_crop}: must be a positive multiple of 8 (the VAE divides by 8).")
    return out


def _vae_shape(cfg: TrainConfig) -> list[str]:
    widths, groups = cfg.vae_widths, cfg.vae_norm_groups
    if len(widths) != 4 or min(widths) < 1:
        return [f"--vae-widths {_text(widths)}: must be four positive channel counts (8x needs four blocks)."]
    if groups < 1 or any(w % groups for w in widths):
        return [f"--vae-norm-groups {groups}: must divide every width of --vae-widths {_text(widths)}."]
    return []


def _choices(cfg: TrainConfig) -> list[str]:
    out = []
    if cfg.vae_loss not in VAE_LOSSES:
        out.append(f"--vae-loss {cfg.vae_loss}: allowed: {', '.join(VAE_LOSSES)}.")
    for name in ("train_pictures", "eval_pictures"):
        unknown = [p for p in getattr(cfg, name) if not pictures.exists(p)]
        if unknown:
            out.append(
                f"--{_option(name)}: {', '.join(unknown)} is not a picture shipped in an installed package "
                f"(package:name, packages {', '.join(pictures.PACKAGES)})."
            )
    if not cfg.train_pictures or not cfg.eval_pictures:
        out.append("--train-pictures and --eval-pictures must each name at least one picture.")
    if any(s < 1 for s in cfg.eval_cfg_scales) or not cfg.eval_cfg_scales:
        out.append(f"--eval-cfg-scales {_text(cfg.eval_cfg_scales)}: each must be at least 1 (1: true CFG off).")
    return out


def _init_problems(cfg: TrainConfig) -> list[str]:
    """The ``init`` folder must be one this recipe wrote with the VAE shape and text length asked for."""
    if not cfg.init:
        return []
    folder = Path(cfg.init)
    try:
        vae = json.loads((folder / "vae" / "config.json").read_text())
        json.loads((folder / "transformer" / "config.json").read_text())
        text_len = json.loads((folder / "tokenizer_2" / "tokenizer_config.json").read_text())["model_max_length"]
    except (OSError, ValueError, KeyError):
        return [f"--init {folder}: not a pipeline folder this recipe wrote (vae/, transformer/, tokenizer_2/)."]
    shape = {
        "vae_widths": tuple(vae["block_out_channels"]),
        "vae_layers": vae["layers_per_block"],
        "vae_norm_groups": vae["norm_num_groups"],
        "text_len": text_len,
    }
    return [
        f"--{_option(name)} {_text(getattr(cfg, name)) if isinstance(value, tuple) else getattr(cfg, name)}: "
        f"must be {_text(value) if isinstance(value, tuple) else value}, the --init folder's."
        for name, value in shape.items()
        if getattr(cfg, name) != value
    ]


def edit_weights(text: str) -> dict[str, float]:
    """``name=weight,...`` -> {name: weight}; raises ValueError naming what is wrong."""
    from ditrun.editor import transforms

    weights = {}
    for item in (part for part in text.split(",") if part):
        name, sep, value = item.partition("=")
        if not sep or name not in transforms.EDITS.names():
            raise ValueError(f"{item!r} is not edit=weight with an edit of {', '.join(transforms.EDITS.names())}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: the weight must be a number") from None
        if not weights[name] >= 0:
            raise ValueError(f"{item!r}: a weight must not be negative")
    if weights and not sum(weights.get(n, 1.0) for n in transforms.EDITS.names()) > 0:
        raise ValueError("at least one edit needs a weight above 0")
    return weights


def _edit_weight_problems(cfg: TrainConfig) -> list[str]:
    try:
        edit_weights(cfg.edit_weights)
    except ValueError as error:
        return [f"--edit-weights {cfg.edit_weights}: {error}."]
    return []


def problems(cfg: TrainConfig) -> list[str]:
    """One sentence per wrong setting (empty when every value is usable)."""
    out = _geometry(cfg) + _vae_shape(cfg) + _choices(cfg) + _init_problems(cfg) + _edit_weight_problems(cfg)
    out += _positive(cfg, "vae_batch", "vae_layers", "dit_batch", "pool", "text_len", "eval_steps", "log_every")
    out += _not_negative(
        cfg, "vae_steps", "dit_steps", "warmup", "dit_stop_after", "eval_every", "vae_kl", "vae_loss_weight"
    )
    out += [f"--{_option(n)} {getattr(cfg, n)}: must be above 0." for n in ("vae_lr", "dit_lr") if getattr(cfg, n) <= 0]
    out += _fraction(cfg, "prompt_dropout", 0.99) + _fraction(cfg, "ema", 0.99999) + _fraction(cfg, "dead_leaves", 1)
    out += _fraction(cfg, "vae_edited", 1) + _fraction(cfg, "grey_untinted", 1)
    if cfg.dit_stop_after > cfg.dit_steps:
        out.append(f"--dit-stop-after {cfg.dit_stop_after}: must be at most --dit-steps {cfg.dit_steps}.")
    return out


def device_problem(name: str) -> Optional[str]:
    """``--device name`` in one sentence where this machine cannot run it (the training's and the evaluation's)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"--device {name}: not a device torch knows (cpu, cuda, cuda:1, ...)."
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {name}: this machine has no CUDA device; use --device cpu."
    return None if device.type in ("cpu", "cuda") else f"--device {name}: allowed: cpu or cuda."


def _option(name: str) -> str:
    return name.replace("_", "-")


def _text(values: tuple) -> str:
    return ",".join(str(v) for v in values)


def add_options(parser) -> None:
    """One option per field, its default the field's; tuples are written comma-separated."""
    for field in dataclasses.fields(TrainConfig):
        default = field.default
        kind = type(default[0]) if isinstance(default, tuple) else type(default)
        shown = _text(default) if isinstance(default, tuple) else default
        parser.add_argument(
            "--" + _option(field.name),
            type=_parser(kind, isinstance(default, tuple)),
            default=default,
            help=f"default {shown}",
            metavar=kind.__name__.upper(),
        )


def _parser(kind: type, many: bool):
    def parse(text: str):
        return tuple(kind(item) for item in text.split(",") if item) if many else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its sentence: "invalid int value: 'x'"
    return parse


def from_options(args) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


# What a phase's checkpoint must agree on with the command that resumes it: the VAE phase on what trains the VAE
# (so a VAE-only command, --dit-steps 0, hands its VAE to the full training); the DiT phase on everything but what
# is only measured or logged.
MEASURED_ONLY = ("eval_pictures", "eval_steps", "eval_cfg_scales", "eval_every", "log_every")
VAE_FIELDS = (
    "seed",
    "init",
    "size",
    "train_pictures",
    "vae_steps",
    "vae_batch",
    "vae_crop",
    "vae_lr",
    "vae_kl",
    "vae_widths",
    "vae_layers",
    "vae_norm_groups",
    "vae_loss",
    "vae_loss_weight",
    "dead_leaves",
    "grey_untinted",
    "vae_edited",
    "edit_weights",
    "warmup",
)


def phase_fields(phase: str) -> tuple:
    if phase == "vae":
        return VAE_FIELDS
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in MEASURED_ONLY)


def changed(saved: dict, cfg: TrainConfig, names: tuple) -> Optional[str]:
    """The first of ``names`` whose value differs from a checkpoint's (``saved``: its ``dataclasses.asdict``), as
    ``--option then, not now``; None when they all agree. A setting the checkpoint does not hold (an option added
    after it was made) is taken as that option's default, which is what the checkpoint's training did."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for name in names:
        now, then = getattr(cfg, name), saved.get(name, defaults[name])
        if (tuple(then) if isinstance(then, list) else then) != now:
            shown = [_text(v) if isinstance(v, (list, tuple)) else v for v in (then, now)]
            return f"--{_option(name)} {shown[0]}, not {shown[1]}"
    return None
