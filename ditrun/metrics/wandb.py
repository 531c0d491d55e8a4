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

Nothing here writes or sends an API key: online mode takes the login W&B itself keeps, and ditrun only looks
that there is one (and that W&B's server answers) before it starts an online run (``mode_to_run``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
from omegaconf import OmegaConf

from ditrun.devices import dtype_name
from ditrun.errors import UserError
from ditrun.metrics import wandb_file
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


# How long W&B's server gets to answer the check before an online run (``online_problem``).
SERVER_CHECK_S = 5.0
DEFAULT_BASE_URL = "https://api.wandb.ai"


def online_problem(environ=os.environ) -> Optional[str]:
    """Why an online W&B run cannot start from here, as a phrase (None when it can): no API key (W&B's variable or
    its netrc entry), or a server that does not answer an HTTP request within ``SERVER_CHECK_S``."""
    base_url = environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
    if not (environ.get("WANDB_API_KEY") or _netrc_key(base_url, environ)):
        return "there is no W&B API key here (WANDB_API_KEY, or `wandb login`)"
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(base_url, timeout=SERVER_CHECK_S).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        return f"W&B's server {base_url} did not answer within {SERVER_CHECK_S:g} s ({reason})"
    return None


def _netrc_key(base_url: str, environ) -> Optional[str]:
    import netrc
    from urllib.parse import urlparse

    path = environ.get("NETRC") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(urlparse(base_url).hostname or "")
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry else None


def mode_to_run(cfg, out_dir: Path) -> str:
    """The W&B mode this run logs in: ``wandb.mode``, but offline (with one warning line saying where to upload it
    from) when an online run cannot start (``online_problem``). Global rank 0 asks before it claims the directory."""
    if cfg.wandb.mode != "online":
        return cfg.wandb.mode
    print(
        f"ditrun: asking W&B's server {os.environ.get('WANDB_BASE_URL') or DEFAULT_BASE_URL} "
        f"(up to {SERVER_CHECK_S:g} s)",
        flush=True,
    )
    problem = online_problem()
    if problem is None:
        return "online"
    print(
        f"ditrun: warning: wandb.mode=online, but {problem}: this run logs offline under {out_dir / 'wandb'}; "
        f"upload it later with `wandb sync {out_dir / 'wandb'}/offline-run-*`",
        file=sys.stderr,
        flush=True,
    )
    return "offline"


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

    def log_others(self, records: list[dict]) -> None:
        pass

    def finish(self, records: list[dict], summary: dict, out_dir: Path, references=None, failed: bool = False) -> None:
        pass


class WandbLogger:
    """One history row per edit, with ``edit_index`` (the edit's place in the directory's workload) as the x-axis of
    every per-edit metric.

    Every attempt of a run (a requeued job, a rerun) continues one W&B run (``start``). An attempt first logs the
    edits earlier attempts finished but whose rows no earlier offline file holds (an attempt killed outright
    loses what W&B had not yet written), then its own: across the attempts' files every edit is logged once, at
    steps that only go up (W&B drops a resumed run's rows whose step goes back)."""

    def __init__(self, run, init_s: float, images: int, edits: list[str], logged: set[str], first_step: int):
        self.run, self.init_s, self.images = run, init_s, images
        self.index = {edit: i for i, edit in enumerate(edits)}
        self.logged, self.step = set(logged), first_step
        run.define_metric("edit_index")
        for key in HISTORY_FIELDS:
            run.define_metric(key, step_metric="edit_index")

    @property
    def location(self) -> Path:
        return Path(self.run.dir).parent  # run.dir is the run's files/ folder

    def log_edit(self, record: dict) -> None:
        """One history row; called after the edit's timed region has ended."""
        row = {key: record[key] for key in HISTORY_FIELDS if _is_number(record.get(key))}
        self.run.log({**row, "edit_index": self.index.get(record["edit"], -1)}, step=self.step)
        self.step += 1
        self.logged.add(record["edit"])

    def log_others(self, records: list[dict]) -> None:
        """The rows of finished edits not logged yet: earlier attempts' that their files lack, and other replicas'
        (only global rank 0 logs as edits finish)."""
        for record in records:
            if record["edit"] not in self.logged:
                self.log_edit(record)

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
        images.append(wandb.Image(reference.image, caption=f"full-quality reference ({dtype_name(references.dtype)})"))
        picture, caption = ssim_map_picture(ssim_map(output, reference.image), record["ssim"])
        images.append(wandb.Image(picture, caption=caption))
    return {f"images/{record['edit']}": images}


def ssim_map_picture(local: np.ndarray, ssim: float) -> tuple[np.ndarray, str]:
    """Where the output differs from the reference, as a picture and its caption: 1 - local SSIM, stretched so that
    the largest difference is white (drawn as it is, SSIM near 1 everywhere is a blank white square)."""
    loss = 1.0 - local.clip(-1.0, 1.0)  # 0 where identical
    top = float(loss.max())
    if top <= 0:
        return np.zeros(loss.shape, np.uint8), f"SSIM map ({ssim:.4f}): identical everywhere"
    picture = (loss / top * 255).round().astype(np.uint8)
    return picture, f"SSIM map ({ssim:.4f}): black = identical, white = local SSIM {1 - top:.4f}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _loggable(value) -> bool:
    return value is None or isinstance(value, (str, bool)) or _is_number(value)


def _init(cfg, out_dir: Path, mode: Optional[str] = None, **run_fields):
    """``wandb.init`` under ``out_dir/wandb`` in ``mode`` (``wandb.mode`` unless given; offline: nothing leaves the
    machine)."""
    mode = mode or cfg.wandb.mode
    if mode == "offline":
        os.environ.update(OFFLINE_ENVIRONMENT)
    import wandb

    files.owned_folder(out_dir / files.WANDB_DIR)  # W&B writes into it as it finds it: a real folder of ours
    settings = wandb.Settings(
        silent=True, console="off", disable_git=True, save_code=False, x_disable_stats=True, x_disable_machine_info=True
    )
    return wandb.init(
        mode=mode,
        dir=str(out_dir),
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        settings=settings,
        reinit="finish_previous",
        **run_fields,
    )


def start(
    cfg,
    out_dir: Path,
    is_global_rank0: bool = True,
    attempt: Optional[dict] = None,
    edits=(),
    done=(),
    mode: Optional[str] = None,
):
    """The run's logger: a W&B run under ``out_dir/wandb`` on global rank 0, else one that does nothing.

    ``attempt`` (``results.rundir.attempt_of``) gives the W&B run's id, so that every attempt of a run continues
    one W&B run; ``edits`` are the directory's edits, ``done`` the records earlier attempts finished; ``mode`` the
    mode to run (``mode_to_run``; unset: ``wandb.mode``)."""
    mode = mode or cfg.wandb.mode
    if mode == "disabled" or not is_global_rank0:
        return NullLogger()
    attempt = attempt or {}
    records_done, edits, done = list(done), list(edits), [r["edit"] for r in done]
    # The earlier attempts' offline files, read before this attempt adds its own.
    rows, ended = _earlier_offline_rows(mode, out_dir, attempt)
    if _already_whole(mode, edits, done, attempt, rows, ended):
        return NullLogger()  # a rerun with nothing left to do adds nothing to the W&B run
    begin = time.perf_counter()
    run = _init(
        cfg,
        out_dir,
        mode,
        id=attempt.get("wandb_id"),
        resume="allow" if attempt.get("wandb_id") else None,
        group=cfg.wandb.group,
        name=cfg.wandb.name or default_name(cfg),
        job_type=cfg.layout.name,
        tags=[f"precision:{precision_label(cfg)}", f"transport:{cfg.transport.name}", *cfg.wandb.tags],
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    if attempt:
        run.summary.update({"attempt": attempt["attempt"], "restarts": attempt.get("restarts", {})})
    logged, first_step = _logged_and_next_step(mode, run, edits, done, rows)
    logger = WandbLogger(run, time.perf_counter() - begin, cfg.wandb.images, edits, logged, first_step)
    logger.log_others(list(records_done))
    return logger


def _earlier_offline_rows(mode: str, out_dir: Path, attempt: dict) -> tuple[list[dict], bool]:
    """The history rows of the earlier attempts' offline files and whether the last one ended ([] and False online
    or for a first attempt)."""
    if mode != "offline" or not attempt.get("wandb_id"):
        return [], False
    return wandb_file.earlier_attempts(out_dir / files.WANDB_DIR, attempt["wandb_id"])


def _already_whole(mode: str, edits: list[str], done: list[str], attempt: dict, rows: list[dict], ended: bool) -> bool:
    """Whether earlier attempts finished every edit and their W&B run holds them all and ended (offline: from its
    files' ``rows``; online: taken to be so once every edit is done)."""
    if not edits or not set(edits) <= set(done) or not attempt.get("wandb_id"):
        return False
    if mode != "offline":
        return True
    logged = {int(row["edit_index"]) for row in rows if "edit_index" in row}
    return ended and logged >= set(range(len(edits)))


def _logged_and_next_step(mode: str, run, edits: list[str], done: list[str], rows: list[dict]) -> tuple[set[str], int]:
    """The edits whose rows earlier attempts' W&B files hold, and the step after their last row. Offline, from those
    files' ``rows``; online, W&B's server holds them: it says where the run's steps go on, and what was logged there
    is taken to be every edit done."""
    if mode != "offline":
        return set(done), int(getattr(run, "starting_step", 0) or 0)
    logged = {edits[int(row["edit_index"])] for row in rows if 0 <= int(row.get("edit_index", -1)) < len(edits)}
    return logged, max((int(row.get("_step", -1)) for row in rows), default=-1) + 1


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
