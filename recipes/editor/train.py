"""Train ditrun's editor from a seed: the VAE on picture crops and dead-leaves pictures, then the DiT on edits, then
judge it on held-out pictures (docs/EDITOR.md). From the repository's root:

    python -m recipes.editor.train --out FOLDER [--replace] [--checkpoint-dir DIR [--resume]] [--max-minutes M]

Writes a diffusers ``FluxKontextPipeline`` folder to ``--out`` (text encoders and tokenizers from ``folder.py``,
the VAE and the DiT trained here, bf16/fp16 safetensors), built beside it under a temporary name and renamed into
place only when complete; an existing non-empty ``--out`` is refused unless ``--replace`` is given. Beside it, in
``--log-dir`` (default ``<out>.training``): ``losses.jsonl`` (one line per logged step and per measurement),
``eval.json`` (the held-out measures), ``train.json`` (settings, times, library versions) and, when W&B is
installed, an offline W&B run.

With ``--checkpoint-dir`` the phases' states are saved every ``--checkpoint-every`` steps; ``--max-minutes`` (or
``--max-steps``) stops the command with a checkpoint and exit status 75, and the same command with ``--resume``
continues the same loss curve (``--resume=required``: only from a checkpoint, refused where there is none, as on a
machine other than the one the command before ran on). Everything random comes from ``--seed``; on a GPU the
attention runs PyTorch's math backend and deterministic algorithms are asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ditrun.editor import transforms
from recipes.editor import config
from recipes.editor import folder as parts
from recipes.editor.checkpoint import Checkpoints, fingerprint
from recipes.editor.config import TrainConfig, device_problem
from recipes.editor.data import Batches, Crops, Pool
from recipes.editor.dit import make_dit, prompt_table
from recipes.editor.evaluate import judge, report
from recipes.editor.output import Staging, refusal
from recipes.editor.phases import COMPILE_MODES, Budget, DitPhase, Stopped, VaePhase, run_phase
from recipes.editor.vae import Codec, encoder_weights, load_vae

EXIT_USAGE = 2
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by the budget with a checkpoint; the same command with --resume continues
RESUMES = ("if-any", "required")
PHASES = ("vae", "dit")


@dataclasses.dataclass
class Run:
    """How this command runs: where things go and when it stops; none of it changes the trained folder."""

    out: Path
    replace: bool
    log_dir: Path
    checkpoint_dir: Optional[Path]
    resume: str
    """'' (a new training), 'if-any' or 'required' (``RESUMES``)."""
    checkpoint_every: int
    max_minutes: float
    max_steps: int
    compile: str
    device: str
    vae_from: Optional[Path]
    wandb: bool


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.editor.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the pipeline folder to write")
    p.add_argument("--replace", action="store_true", help="replace a non-empty --out once the new folder is complete")
    p.add_argument("--log-dir", type=Path, help="losses, evaluation and W&B run (default: <out>.training)")
    p.add_argument("--checkpoint-dir", type=Path, help="where the phases' training states are saved")
    p.add_argument(
        "--resume",
        nargs="?",
        const=RESUMES[0],
        default="",
        choices=RESUMES,
        help="continue from --checkpoint-dir: 'if-any' (the flag alone) starts from the beginning where it holds no "
        "checkpoint; 'required' refuses then",
    )
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (default 500)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop with a checkpoint after this long (0: never)")
    p.add_argument("--max-steps", type=int, default=0, help="stop with a checkpoint after this many steps (0: never)")
    p.add_argument(
        "--compile",
        default="auto",
        help=f"one of {', '.join(COMPILE_MODES)} (default auto: inductor on CUDA, eager elsewhere)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--vae-from",
        type=Path,
        help="a vae/ folder this recipe wrote: train only the DiT on it (with --init: a VAE whose decoder alone was "
        "trained from the --init folder's, to carry that folder's DiT)",
    )
    p.add_argument("--no-wandb", dest="wandb", action="store_false", help="no offline W&B run, losses.jsonl only")
    config.add_options(p)
    return p


def run_options(args) -> Run:
    log_dir = args.log_dir or args.out.with_name(args.out.name + ".training")
    return Run(
        args.out,
        args.replace,
        log_dir,
        args.checkpoint_dir,
        args.resume,
        args.checkpoint_every,
        args.max_minutes,
        args.max_steps,
        args.compile,
        args.device,
        args.vae_from,
        args.wandb,
    )


def _budget_problems(run: Run) -> list[str]:
    out = [
        f"--{name} {value}: must not be negative."
        for name, value in (
            ("max-minutes", run.max_minutes),
            ("max-steps", run.max_steps),
            ("checkpoint-every", run.checkpoint_every),
        )
        if value < 0
    ]
    if (run.max_minutes or run.max_steps) and run.checkpoint_dir is None:
        out.append("--max-minutes and --max-steps need --checkpoint-dir: the work done would be lost.")
    if run.resume and run.checkpoint_dir is None:
        out.append("--resume needs --checkpoint-dir, the folder to continue from.")
    return out


def _checkpoint_problem(run: Run, cfg: TrainConfig, saved: Optional[dict]) -> Optional[str]:
    folder = run.checkpoint_dir
    if folder is None:
        return None
    if folder.exists() and not folder.is_dir():
        return f"--checkpoint-dir {folder} is a file, not a folder."
    if folder.is_dir() and any(folder.iterdir()) and not run.resume:
        return f"--checkpoint-dir {folder} holds a training; pass --resume to continue it, or name an empty folder."
    if saved is None:
        return None
    if run.resume == "required" and not saved:
        return (
            f"--resume=required: {folder} holds no checkpoint of a phase (the command before ran on another machine, "
            "or the folder was removed); start the training again without it, or name the folder that holds it."
        )
    for phase, state in saved.items():
        difference = config.changed(state["config"], cfg, config.phase_fields(phase))
        if difference:
            return (
                f"--resume: {folder / (phase + '.pt')} was made with {difference}; resume with the same "
                "settings or start another --checkpoint-dir."
            )
    return None


def _path_problems(run: Run, cfg: TrainConfig) -> list[str]:
    out = [refusal(run.out, run.replace)]
    logs = run.log_dir
    if logs.is_dir() and any(logs.iterdir()) and not (run.replace or run.resume):
        out.append(
            f"--log-dir {logs} holds an earlier training's records; pass --replace (or --resume) to "
            "overwrite them, or name another --log-dir."
        )
    files = ("config.json", "diffusion_pytorch_model.safetensors")
    if run.vae_from is not None and not all((run.vae_from / name).is_file() for name in files):
        out.append(
            f"--vae-from {run.vae_from}: no config.json and safetensors weights there; name the vae/ folder of a "
            "pipeline folder."
        )
    elif run.vae_from is not None and cfg.init:
        out += _vae_from_problems(run.vae_from, cfg)
    if run.compile not in COMPILE_MODES:
        out.append(f"--compile {run.compile}: allowed: {', '.join(COMPILE_MODES)}.")
    return [sentence for sentence in out if sentence]


def _vae_from_problems(vae_from: Path, cfg: TrainConfig) -> list[str]:
    """With ``--init``, ``--vae-from`` names another decoder for the folder's DiT: its encoder and latent statistics
    must be the folder's, so that the DiT's latents stay what it learnt."""
    if cfg.vae_steps:
        return [f"--vae-from with --init trains only the DiT, on that VAE: --vae-steps {cfg.vae_steps} must be 0."]
    if not same_encoder(vae_from, Path(cfg.init) / "vae"):
        return [
            f"--vae-from {vae_from}: its encoder or latent statistics differ from the --init folder's VAE, so the "
            "folder's DiT would read other latents; name a VAE whose decoder alone was trained from that folder."
        ]
    return []


def same_encoder(a: Path, b: Path) -> bool:
    """Whether two ``vae/`` folders encode alike: the same encoder weights, shape and latent statistics."""
    from safetensors.torch import load_file

    configs = [json.loads((path / "config.json").read_text()) for path in (a, b)]
    keys = ("block_out_channels", "layers_per_block", "norm_num_groups", "latent_channels")
    if any(configs[0].get(k) != configs[1].get(k) for k in keys + ("scaling_factor", "shift_factor")):
        return False
    weights = [load_file(str(path / "diffusion_pytorch_model.safetensors")) for path in (a, b)]
    encoder = [encoder_weights(w) for w in weights]
    return encoder[0].keys() == encoder[1].keys() and all(torch.equal(v, encoder[1][k]) for k, v in encoder[0].items())


def load_checkpoints(run: Run) -> dict:
    """The phases' saved states (phase -> state) when resuming; a phase never saved is absent."""
    if not run.resume or run.checkpoint_dir is None or not run.checkpoint_dir.is_dir():
        return {}
    store = Checkpoints(run.checkpoint_dir, None)
    return {phase: state for phase in PHASES if (state := store.load(phase)) is not None}


# ---------------------------------------------------------------------------------------------
# The records


class Log:
    """Losses and measurements to ``losses.jsonl`` and, when W&B is installed, to an offline W&B run (as a ditrun
    run logs). A resumed training keeps the lines before its checkpoint and drops the ones after it, which the
    resumed steps write again."""

    def __init__(self, run: Run, cfg: TrainConfig, position: tuple):
        run.log_dir.mkdir(parents=True, exist_ok=True)
        path = run.log_dir / "losses.jsonl"
        kept = (
            [line for line in path.read_text().splitlines() if _before(json.loads(line), position)]
            if run.resume and path.is_file()
            else []
        )
        self.file = path.open("w")
        self.file.write("".join(line + "\n" for line in kept))
        self.start = time.perf_counter()
        self.run = _wandb_run(run.log_dir, cfg) if run.wandb else None

    def __call__(self, row: dict) -> None:
        row = {**row, "elapsed_s": round(time.perf_counter() - self.start, 2)}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if k != "phase"})
        if row["step"] % 500 == 0 or any(k.endswith(("eval_psnr", "eval_margin")) for k in row):
            print("train:", json.dumps(row), flush=True)

    def finish(self, summary: dict, exit_code: int = 0) -> None:
        self.file.close()
        if self.run is not None:
            self.run.summary.update(summary)
            self.run.finish(exit_code=exit_code)


def _before(row: dict, position: tuple) -> bool:
    return (PHASES.index(row["phase"]), row["step"]) < position


def _wandb_run(log_dir: Path, cfg: TrainConfig):
    try:
        import wandb

        from ditrun.metrics.wandb import OFFLINE_ENVIRONMENT
    except ImportError:
        print("train: wandb is not installed; losses go to losses.jsonl only", flush=True)
        return None
    os.environ.update(OFFLINE_ENVIRONMENT)
    return wandb.init(
        project="ditrun", job_type="train-editor", dir=str(log_dir), mode="offline", config=dataclasses.asdict(cfg)
    )


def resume_position(saved: dict) -> tuple:
    """(phase index, step) where the resumed training starts: log lines from there on are written again."""
    if "dit" in saved:
        return 1, saved["dit"]["step"]
    if "vae" in saved:
        return (1, 0) if saved["vae"]["done"] else (0, saved["vae"]["step"])
    return 0, 0


# ---------------------------------------------------------------------------------------------
# The phases


def vae_phase(
    cfg: TrainConfig, run: Run, crops: Crops, device: torch.device, saved: dict, store: Checkpoints, budget: Budget, log
):
    """The trained VAE: loaded (``--vae-from``), taken from a finished phase's checkpoint, or trained (resumed)."""
    if run.vae_from is not None:
        return load_vae(run.vae_from, device)
    phase = VaePhase(cfg, crops, device, run.compile)
    state = saved.get("vae")
    if state is not None and state["done"]:
        return phase.restore_finished(state)
    run_phase(phase, phase.restore(state) if state else 0, cfg, store, run.checkpoint_every, budget, log)
    vae = phase.finish()
    store.save("vae", phase.finished_state())
    return vae


def dit_phase(
    cfg: TrainConfig,
    run: Run,
    crops: Crops,
    codec: Codec,
    table,
    prompt_index: dict,
    device: torch.device,
    saved: dict,
    store: Checkpoints,
    budget: Budget,
    log,
):
    """The trained DiT's EMA. Its pool of encoded crops is drawn again on resumption, from the data generator's
    state when it was first drawn."""
    if cfg.dit_steps == 0:  # a VAE-only command: the --init folder's DiT, or an untrained one, fills transformer/
        return make_dit(device, cfg.init).eval()
    state = saved.get("dit")
    pool_state = state["pool_state"] if state else crops.gen.get_state()
    start = time.perf_counter()
    pool, read = encoded_pool(cfg, crops, codec, pool_state, store, device)
    done = "read from " + str(store.path("pool")) if read else "encoded"
    print(f"train: pool of {cfg.pool} crops {done} in {time.perf_counter() - start:.1f} s", flush=True)
    batches = Batches(pool, prompt_index, cfg.prompt_dropout, crops.gen, config.edit_weights(cfg.edit_weights))
    phase = DitPhase(cfg, batches, table, codec, device, run.compile, pool_state)
    run_phase(phase, phase.restore(state) if state else 0, cfg, store, run.checkpoint_every, budget, log)
    return phase.ema


def encoded_pool(
    cfg: TrainConfig, crops: Crops, codec: Codec, pool_state: torch.Tensor, store: Checkpoints, device: torch.device
) -> tuple[Pool, bool]:
    """The DiT's pool, drawn from the data generator at ``pool_state``, and the generator left after it; read from
    the checkpoint folder where an earlier command of the training encoded the same pool (the same generator state,
    pictures, crops, sizes, edits' definitions, VAE encoder and device kind), else encoded and kept there.
    -> (pool, read)"""
    key = fingerprint(
        pool_state,
        cfg.train_pictures,
        cfg.grey_untinted,
        inspect.getsource(transforms),  # the correct outputs the pool holds are these definitions'
        cfg.pool,
        cfg.size,
        encoder_weights(codec.vae.state_dict()),
        codec.scale,
        codec.shift,
        device.type,
    )

    def encode() -> dict:
        crops.gen.set_state(pool_state)
        pool = Pool.encode(crops, codec, cfg.pool, cfg.size)
        return {"refs": pool.refs, "targets": pool.targets, "data_state": crops.gen.get_state()}

    saved, read = store.cached("pool", key, encode)
    crops.gen.set_state(saved["data_state"])
    return Pool(saved["refs"].to(device), saved["targets"].to(device)), read


def save_folder(folder: Path, vae, dit) -> None:
    from ditrun.model.load import save_pretrained

    vae.half().save_pretrained(folder / "vae", safe_serialization=True)
    save_pretrained(dit.to(torch.bfloat16), folder / "transformer")


def train_into(staging: Path, cfg: TrainConfig, run: Run, saved: dict, log) -> tuple[dict, dict]:
    """Both phases and the judgement, the folder written into ``staging``; -> (evaluation, times)."""
    device, times = torch.device(run.device), {}
    store, budget = Checkpoints(run.checkpoint_dir, cfg), Budget(run.max_minutes, run.max_steps)
    if cfg.init:
        parts.copy_text_parts(Path(cfg.init), staging)
    else:
        parts.write_text_parts(staging, cfg.seed, cfg.text_len)
    crops = Crops(cfg.train_pictures, device, torch.Generator().manual_seed(cfg.seed), cfg.grey_untinted)
    start = time.perf_counter()
    vae = vae_phase(cfg, run, crops, device, saved, store, budget, log)
    times["vae_s"] = time.perf_counter() - start
    table, prompt_index = prompt_table(staging, cfg.text_len, device)
    codec, start = Codec(vae), time.perf_counter()
    dit = dit_phase(cfg, run, crops, codec, table, prompt_index, device, saved, store, budget, log)
    times["dit_s"], start = time.perf_counter() - start, time.perf_counter()
    result = judge(cfg, dit, codec, table, prompt_index, device)
    times["eval_s"] = time.perf_counter() - start
    save_folder(staging, vae, dit)
    return result, times


def train(cfg: TrainConfig, run: Run, saved: dict) -> dict:
    """Train, write ``--out`` (only when complete) and the records; returns the evaluation."""
    torch.manual_seed(cfg.seed)
    if run.device.startswith("cuda"):
        torch.use_deterministic_algorithms(True, warn_only=True)
    log = Log(run, cfg, resume_position(saved))
    staging = Staging(run.out)
    try:
        result, times = train_into(staging.path, cfg, run, saved, log)
        staging.publish()
    except BaseException as error:
        staging.discard()
        log.finish({}, exit_code=EXIT_STOPPED if isinstance(error, Stopped) else 1)
        raise
    record = {
        "config": dataclasses.asdict(cfg),
        "run": {k: str(v) for k, v in dataclasses.asdict(run).items()},
        "times": times,
        "device": _device_name(run.device),
        "versions": _versions(),
    }
    (run.log_dir / "train.json").write_text(json.dumps(record, indent=2) + "\n")
    (run.log_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    log.finish(_flat_summary(result))
    return result


def _flat_summary(result: dict) -> dict:
    return {
        f"eval/{setting}/{edit}/{key}": value
        for setting, table in result["summary"].items()
        for edit, row in table.items()
        for key, value in row.items()
    }


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def _versions() -> dict:
    import diffusers
    import transformers

    return {"torch": torch.__version__, "diffusers": diffusers.__version__, "transformers": transformers.__version__}


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    cfg, run = config.from_options(args), run_options(args)
    sentences = config.problems(cfg) + _budget_problems(run) + _path_problems(run, cfg)
    wrong_device = device_problem(run.device)
    saved = load_checkpoints(run) if not sentences else None  # None: not read, another sentence comes first
    sentences += [s for s in (wrong_device, _checkpoint_problem(run, cfg, saved)) if s]
    if sentences:
        print("\n".join(f"train: {s}" for s in sentences), file=sys.stderr)
        return EXIT_USAGE
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, read at CUDA's start
    # SIGTERM (a scheduler's or a time limit's stop) unwinds as Ctrl-C does, so the folder being built is removed
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        report(train(cfg, run, saved))
    except Stopped as stop:
        print(
            f"train: {stop} (the budget of this command); checkpoint in {run.checkpoint_dir}: the same command "
            "with --resume=required continues it where that folder is",
            flush=True,
        )
        return EXIT_STOPPED
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
