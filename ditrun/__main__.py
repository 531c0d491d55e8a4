"""The ``ditrun`` command: compose the Hydra config and hand it to the launcher.

``ditrun report PATH`` is dispatched before Hydra sees the arguments: it compares finished runs
and composes no config. A user's mistake, whether Hydra finds it on the command line or ditrun
in the config and inputs, is printed as ``ditrun: error: <one sentence>`` with exit status 2;
``DITRUN_DEBUG=1`` shows the traceback behind it. ``ditrun tune key=value ...`` composes
the config itself and tunes the precision backends (``ditrun/tune.py``). ``ditrun warm key=value ...``
is the run of that config with ``warm.enabled=true``: it compiles the workload's shapes into the
compile cache and runs no edit (``ditrun/run/warm.py``). Hydra's ``.hydra/`` files are rendered
here and written by global rank 0 once the results directory is this run's
(``ditrun/results/rundir.py``), never by a run that is refused it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from ditrun import hydra_errors
from ditrun.cli_help import register_help
from ditrun.config import RunConfig, register_configs
from ditrun.errors import UserError
from ditrun.process_exit import run_then_exit

register_configs()
register_help()

# Runs of a multirun that failed the quality gate: the sweep goes on, and the command exits 1 at its end.
_gate_failures: list[str] = []
# Set when Hydra hands the job over: an OSError before that is Hydra's, making or writing the run directory.
_job_started = False
_STARTED = time.time()  # a folder changed since then was made by this run


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: RunConfig) -> None:
    from ditrun.config import take_renamed_keys
    from ditrun.launch import WorkerFailed, launch
    from ditrun.launch.stop import NodeFault, RunStopped
    from ditrun.metrics import full_quality
    from ditrun.metrics.quality import QualityGateError
    from ditrun.metrics.wandb import apply_sweep_defaults
    from ditrun.run import WORK

    global _job_started
    _job_started = True
    hydra_cfg = HydraConfig.get()
    made = _made_by_hydra(Path(hydra_cfg.runtime.output_dir))
    try:
        hydra_errors.check_composed(cfg)
        OmegaConf.resolve(cfg)  # ranks and Slurm jobs get literal values (conf/model/editor.yaml's folder)
        take_renamed_keys(cfg, say=True)  # an old key's notice, once per run
        out_dir = Path(cfg.output_dir) if cfg.output_dir else Path(hydra_cfg.runtime.output_dir)
        hydra_files = _hydra_files(cfg)  # the config as composed, before the sweep's W&B defaults
        if hydra_cfg.mode == RunMode.MULTIRUN:
            apply_sweep_defaults(cfg, hydra_cfg.sweep.dir, hydra_cfg.job.num)
            full_quality.apply_sweep_defaults(cfg, hydra_cfg.sweep.dir)  # one reference for the whole sweep
        launch(cfg, out_dir, WORK, hydra_files)
    except QualityGateError as err:
        print(f"ditrun: error: {err}", file=sys.stderr, flush=True)
        if hydra_cfg.mode != RunMode.MULTIRUN:
            sys.exit(1)
        _gate_failures.append(f"{out_dir}: {err}")
    except NodeFault as err:
        # A node's fault mid-run (a full disk): the finished edits are on disk, the exit status says failure.
        print(
            f"ditrun: error: {err.why}; once the disk has room (or the folder can be written again), rerun the same "
            f"command to resume (results: {out_dir})",
            file=sys.stderr,
            flush=True,
        )
        if hydra_cfg.mode != RunMode.MULTIRUN:
            sys.exit(err.exit_code)
        _job_failed(hydra_cfg, err.why)
    except RunStopped as err:
        # Finished edits are on disk; the exit status (128 + signal) tells a scheduler it was stopped.
        print(f"ditrun: {err}; rerun the same command to resume (results: {out_dir})", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except WorkerFailed as err:
        # The failed rank printed its own traceback; this names it once more, last.
        print(f"ditrun: {err}", file=sys.stderr, flush=True)
        if hydra_cfg.mode != RunMode.MULTIRUN:
            sys.exit(1)
        _job_failed(hydra_cfg, str(err))
    except UserError as err:
        # A user's mistake is one sentence; DITRUN_DEBUG=1 shows the traceback behind it anyway. A refused run
        # leaves nothing behind, not even the empty folder Hydra made for it.
        if made is not None:
            with contextlib.suppress(OSError):  # the other ranks of a refused job remove it too, at once
                made.rmdir()  # only an empty folder: one holding anything stays
        _user_error(err)
    except Exception as err:
        if hydra_cfg.mode != RunMode.MULTIRUN:
            raise
        # A crash of one job of a sweep: its traceback, one line naming it, and the sweep goes on.
        traceback.print_exc()
        _job_failed(hydra_cfg, f"{type(err).__name__}: {err}")


def _made_by_hydra(folder: Path) -> Optional[Path]:
    """``folder`` when Hydra made it for this run (empty, and new since this process started), else None."""
    try:
        new = folder.stat().st_ctime >= _STARTED and not any(folder.iterdir())
    except OSError:
        return None
    return folder if new else None


def _job_failed(hydra_cfg, why: str) -> None:
    """Note a sweep's job that failed (its report lists it as incomplete) and name it in one line."""
    from ditrun.metrics.report import note_failed_job

    note_failed_job(hydra_cfg.sweep.dir, hydra_cfg.runtime.output_dir, hydra_cfg.job.num, hydra_cfg.overrides.task, why)


def _hydra_files(cfg):
    """Hydra's files of this run (what Hydra writes into ``.hydra/``), for rank 0 to write once the directory is
    this run's; None when a user's ``hydra.output_subdir`` has Hydra write them itself."""
    from omegaconf import OmegaConf

    from ditrun.results.rundir import HYDRA_DIR, HydraFiles

    hydra = HydraConfig.instance().cfg  # {"hydra": ...}, as Hydra saves it
    if hydra.hydra.output_subdir is not None:
        return None
    return HydraFiles(
        HYDRA_DIR,
        {
            "config.yaml": OmegaConf.to_yaml(cfg),
            "hydra.yaml": OmegaConf.to_yaml(hydra),
            "overrides.yaml": OmegaConf.to_yaml(hydra.hydra.overrides.task),
        },
    )


def _user_error(err: BaseException, sentence: str | None = None) -> None:
    if os.environ.get("DITRUN_DEBUG"):
        raise err
    print(f"ditrun: error: {sentence or err}", file=sys.stderr, flush=True)
    sys.exit(2)


def _compose_and_run() -> None:
    """Run Hydra's main; a mistake Hydra finds while composing the config becomes one sentence.

    Hydra prints its own errors and exits 1 unless ``HYDRA_FULL_ERROR`` is set, in which case it
    raises them: ditrun sets it (a user who set it already sees Hydra's traceback, as Hydra says).
    """
    from ditrun.launch.slurm import warn_of_sacct_once

    warn_of_sacct_once()  # a Slurm sweep's launcher polls sacct, which may fail at every poll
    users_setting = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except Exception as err:
        sentence = None if users_setting else _hydra_error_sentence(err)
        if sentence is None:
            raise
        _user_error(err, sentence)
    finally:
        if users_setting is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)


def _hydra_error_sentence(err: Exception) -> str | None:
    """A mistake Hydra found composing the config, or a run directory it could not make or write (or that its log
    refused: ``results.files.RunLogFile``)."""
    cause = err
    # logging wraps its file's error in a ValueError
    while cause is not None and not isinstance(cause, (OSError, UserError)):
        cause = cause.__cause__
    if isinstance(cause, UserError):
        return str(cause)
    from ditrun.launch.slurm import refused_submission

    refused = refused_submission(err)
    if refused is not None:
        return refused
    if cause is not None and not _job_started:
        from ditrun.results.rundir import unusable_dir_sentence

        return unusable_dir_sentence(cause) or hydra_errors.sentence(err)
    return hydra_errors.sentence(err)


def main() -> None:
    if sys.argv[1:2] == ["report"]:
        from ditrun.metrics.report import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    if sys.argv[1:2] == ["tune"]:
        from ditrun.tune import main as tune_main

        sys.exit(tune_main(sys.argv[2:]))
    if sys.argv[1:2] == ["warm"]:  # a run of the same config, through the same launchers, that warms instead
        sys.argv = [sys.argv[0], *_with_override(sys.argv[2:], "warm.enabled=true")]
    _compose_and_run()
    _name_failed_jobs()
    if _gate_failures:
        print(f"ditrun: error: {len(_gate_failures)} run(s) of the sweep failed the quality gate:", file=sys.stderr)
        for failure in _gate_failures:
            print(f"  {failure}", file=sys.stderr)
        sys.exit(1)


def _with_override(args: list[str], override: str) -> list[str]:
    """``args`` with ``override`` before their first override: Hydra reads the overrides as one run of arguments,
    which flags (``-m``, ``--cfg job``) may precede or follow."""
    first = next((i for i, arg in enumerate(args) if "=" in arg and not arg.startswith("-")), len(args))
    return [*args[:first], override, *args[first:]]


def _name_failed_jobs() -> None:
    """At the end of a sweep, every job that failed, one line each (its overrides, why); the command then exits 1."""
    from ditrun.metrics.report import FAILED_JOBS

    if not FAILED_JOBS:
        return
    print(f"ditrun: error: {len(FAILED_JOBS)} job(s) of the sweep failed:", file=sys.stderr)
    for folder, (overrides, why) in FAILED_JOBS.items():
        print(f"  {folder} ({' '.join(overrides)}): {why}", file=sys.stderr)
    if not _gate_failures:
        sys.exit(1)


def command() -> None:
    """The ``ditrun`` command: ``main``, then the process ends without the interpreter's teardown
    (``process_exit``); ``main`` alone returns, for callers in a process of their own."""
    run_then_exit(main)


if __name__ == "__main__":
    command()
