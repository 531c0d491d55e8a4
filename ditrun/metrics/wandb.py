"""Weights & Biases: one W&B run per ditrun run, written by global rank 0 only.

``wandb.mode=offline`` (the default) writes the run under the ditrun run directory's
``wandb/`` and never touches the network; ``wandb sync <dir>`` uploads it later. Offline in
``wandb.init`` alone is not enough: the installed wandb (0.31) builds its process-wide settings
from the environment, and with those online it resolves its telemetry host and posts usage
metrics at exit. So, before W&B starts, ``OFFLINE_ENVIRONMENT`` is applied (see there). The W&B run
carries the whole resolved config, one history row per edit, a table of every edit, images
(output, reference, SSIM map) of the first edits, and the run's medians as its summary. It is
grouped by Hydra sweep, typed by layout and tagged with precision and transport so that
layouts, transports and precisions line up side by side in the W&B UI.

Nothing here reads or writes an API key: online mode takes the login W&B itself keeps.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from ditrun.errors import UserError
from ditrun.metrics.quality import ssim_map
from ditrun.results import files

MODES = ("offline", "online", "disabled")
# Set before W&B starts in offline mode; each closes one way W&B would reach for the network.
OFFLINE_ENVIRONMENT = {
    # Process-wide settings offline: no OpenTelemetry proxy (the usage metrics POSTed at exit),
    # and the wandb-core service starts offline too (no API, file-stream or update-check calls).
    "WANDB_MODE": "offline",
    # No error reports (Sentry) and no telemetry recorder, in Python and in wandb-core.
    "WANDB_ERROR_REPORTING": "false",
    # No git remote lookup and no code upload bookkeeping.
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
}
# Record fields logged as history, one row per edit (numbers only; the table has the rest).
HISTORY_FIELDS = (
    "dit_s",
    "encode_s",
    "decode_s",
    "exposed_transfer_s",
    "exposed_transfer_pct",
    "ssim",
    "ssim_rerun",
    "ssim_pct_of_rerun",
    "psnr_target",
    "delta_e_target",
    "margin_db",
    "psnr_target_bf16",
    "margin_db_bf16",
    "ssim_target",
    "ssim_target_bf16",
    "steps_computed",
    "steps_cached",
)
TABLE_COLUMNS = (
    "edit",
    "layout",
    "precision",
    "transport",
    "world",
    "dit_s",
    "exposed_transfer_pct",
    "ssim",
    "ssim_pct_of_rerun",
    "psnr_target",
    "margin_db",
    "delta_e_target",
    "naive_best",
    "target",
    "cache",
    "steps_computed",
    "steps_cached",
    "image",
)


def check_config(wandb_cfg) -> None:
    if wandb_cfg.mode not in MODES:
        raise UserError(f"wandb.mode={wandb_cfg.mode!r} is unknown; allowed: {', '.join(MODES)}.")
    if wandb_cfg.images < 0:
        raise UserError(f"wandb.images={wandb_cfg.images} must be 0 or more.")


def precision_label(cfg) -> str:
    """The precision that runs (a CPU run of the bf16 preset computes in fp32: ``fp32``), not the preset's name."""
    from ditrun.model.build import run_precision_label

    try:
        return run_precision_label(cfg)
    except UserError:  # the worker reports the mistake; a name is no place for it
        return cfg.precision.name


def default_name(cfg) -> str:
    return f"{cfg.layout.name}-{precision_label(cfg)}-{cfg.transport.name}-w{cfg.launcher.world}"


def sweep_group(cfg, sweep_dir) -> str:
    """The W&B group of a sweep's runs: ``wandb.group``, else the sweep directory's last two parts."""
    return cfg.wandb.group if cfg.wandb.group is not None else "/".join(Path(sweep_dir).parts[-2:])


def apply_sweep_defaults(cfg, sweep_dir: str, job_num: int) -> None:
    """In a Hydra multirun: group by the sweep directory, and number the run within it."""
    cfg.wandb.group = sweep_group(cfg, sweep_dir)
    if cfg.wandb.name is None:
        cfg.wandb.name = f"{default_name(cfg)}-job{job_num}"


class NullLogger:
    """``wandb.mode=disabled``, and every rank but global rank 0."""

    location: Optional[Path] = None
    init_s: float = 0.0

    def log_edit(self, record: dict) -> None:
        pass

    def finish(self, records: list[dict], summary: dict, out_dir: Path, references=None, failed: bool = False) -> None:
        pass


class WandbLogger:
    def __init__(self, run, init_s: float, images: int):
        self.run, self.init_s, self.images = run, init_s, images

    @property
    def location(self) -> Path:
        return Path(self.run.dir).parent  # run.dir is the run's files/ folder

    def log_edit(self, record: dict) -> None:
        """One history row; called after the edit's timed region has ended."""
        row = {key: record[key] for key in HISTORY_FIELDS if _is_number(record.get(key))}
        self.run.log(row)

    def finish(self, records: list[dict], summary: dict, out_dir: Path, references=None, failed: bool = False) -> None:
        import wandb

        table = wandb.Table(columns=list(TABLE_COLUMNS))
        for r in records:
            png = out_dir / r["image"]
            table.add_data(*[r.get(c) for c in TABLE_COLUMNS[:-1]], wandb.Image(str(png)) if png.is_file() else None)
        media = {"edits": table}
        for r in records[: self.images]:
            media.update(_edit_images(r, out_dir, references))
        self.run.log(media)
        self.run.summary.update({k: v for k, v in summary.items() if k != "config" and _loggable(v)})
        self.run.finish(exit_code=1 if failed else 0)


def _edit_images(record: dict, out_dir: Path, references) -> dict:
    """Output, reference and SSIM map of one edit (the output alone when there is no reference)."""
    import wandb
    from skimage import io

    png = out_dir / record["image"]
    if not png.is_file():
        return {}
    output = io.imread(png)[..., :3]
    images = [wandb.Image(output, caption="output")]
    reference = references.get(record["edit"]) if references is not None else None
    if reference is not None:
        local = ssim_map(output, reference.image).clip(0, 1)
        images.append(wandb.Image(reference.image, caption="BF16 reference"))
        images.append(wandb.Image((local * 255).round().astype("uint8"), caption=f"SSIM map ({record['ssim']:.4f})"))
    return {f"images/{record['edit']}": images}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _loggable(value) -> bool:
    return value is None or isinstance(value, (str, bool)) or _is_number(value)


def _init(cfg, out_dir: Path, **run_fields):
    """``wandb.init`` under ``out_dir/wandb`` in ``wandb.mode`` (offline: nothing leaves the machine)."""
    if cfg.wandb.mode == "offline":
        os.environ.update(OFFLINE_ENVIRONMENT)
    import wandb

    files.owned_folder(out_dir / files.WANDB_DIR)  # W&B writes into it as it finds it: a real folder of ours
    settings = wandb.Settings(
        silent=True, console="off", disable_git=True, save_code=False, x_disable_stats=True, x_disable_machine_info=True
    )
    return wandb.init(
        mode=cfg.wandb.mode,
        dir=str(out_dir),
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        settings=settings,
        reinit="finish_previous",
        **run_fields,
    )


def start(cfg, out_dir: Path, is_global_rank0: bool = True):
    """The run's logger: a W&B run under ``out_dir/wandb`` on global rank 0, else one that does nothing."""
    if cfg.wandb.mode == "disabled" or not is_global_rank0:
        return NullLogger()
    begin = time.perf_counter()
    run = _init(
        cfg,
        out_dir,
        group=cfg.wandb.group,
        name=cfg.wandb.name or default_name(cfg),
        job_type=cfg.layout.name,
        tags=[f"precision:{precision_label(cfg)}", f"transport:{cfg.transport.name}", *cfg.wandb.tags],
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    return WandbLogger(run, time.perf_counter() - begin, cfg.wandb.images)


def log_sweep_table(cfg, sweep_dir: Path, key: str, columns, rows: list[list]) -> None:
    """One W&B run in the sweep's group (``job_type`` ``report``, under ``sweep_dir/wandb``) holding one table."""
    if cfg.wandb.mode == "disabled":
        return
    import wandb

    group = sweep_group(cfg, sweep_dir)
    run = _init(cfg, sweep_dir, group=group, name=f"{group}-{key}", job_type="report", tags=list(cfg.wandb.tags))
    try:
        run.log({key: wandb.Table(columns=list(columns), data=rows)})
    finally:
        run.finish()
