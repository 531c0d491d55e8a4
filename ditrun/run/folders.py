"""Every folder a run writes, checked before its results directory is claimed; a node's fault mid-run ends it as a
stop does.

What a node does to a run is not the user's mistake, but only the user can move it: a full disk (``ENOSPC``,
``EDQUOT``), a folder that cannot be written (``EACCES``, ``EPERM``), a read-only file system (``EROFS``), a HOME
that is unset or not the user's. Before the directory is claimed, each folder the run will write (the results
directory; the reference cache when SSIM is on; the prompt cache when a pipeline folder encodes prompts; W&B's data,
cache and config folders when W&B is on; matplotlib's when the report is drawn) is made where missing and a probe is
written, flushed and removed in it. A cache or a library's folder that fails moves into the run directory
(``CACHE_DIR``, every rank alike) with one warning line; the results directory is one
sentence naming it and the key or variable that moves it (exit 2). The same fault after the claim ends the run as a
stop does, on every rank (``stop.NodeFault``: the summary of the finished edits and the resume line, where the disk
allows), exit 1; in a cache it does not: the reference cache stops storing with one warning
(``metrics/full_quality_images.py``), the prompt cache moves into the run directory with one (``workload/prompts.py``).
"""

from __future__ import annotations

import errno
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ditrun.errors import UserError
from ditrun.launch.stop import NodeFault
from ditrun.results import files
from ditrun.results.files import is_node_fault  # noqa: F401  (the module's API: the faults it handles)
from ditrun.results.rundir import CACHE_DIR, unusable_dir_sentence

# W&B's own folders (``wandb/env.py``): the variable that moves each, and the part of the user's home it defaults to.
WANDB_FOLDERS = {
    "WANDB_DATA_DIR": ("XDG_DATA_HOME", ".local/share", "wandb"),
    "WANDB_CACHE_DIR": ("XDG_CACHE_HOME", ".cache", "wandb"),
    "WANDB_CONFIG_DIR": ("XDG_CONFIG_HOME", ".config", "wandb"),
}


@dataclass
class RunFolder:
    """A folder the run writes: what it is, where (None: the user's home cannot be found), what moves it, and the
    folder of the run directory's ``CACHE_DIR`` it moves to with ``move`` (None: it cannot move)."""

    what: str
    path: Optional[Path]
    moved_by: str
    fallback: Optional[str] = None
    move: Optional[Callable[[Path], None]] = None


def node_fault(err: OSError) -> NodeFault:
    """The stop of a node's fault (``NODE_ERRNOS``) mid-run: the run ends as a stop does, and exits 1."""
    where = f": {err.filename}" if err.filename else ""
    return NodeFault(f"{err.strerror or err}{where}")


def check_run_folders(cfg, out_dir: Path, wandb_on: bool, announce: bool = True) -> None:
    """Probe every folder of ``run_folders`` (before the claim); move the caches that fail into the run directory
    (one warning line for all, when ``announce``), refuse anything else in one sentence."""
    moved = []
    for folder in run_folders(cfg, out_dir, wandb_on):
        err = _probe(folder.path) if folder.path is not None else None
        if folder.path is not None and err is None:
            continue
        problem = _why(err) if err is not None else NO_HOME
        if folder.move is None:  # the results directory: the sentence Hydra's or the lock's failure would give
            raise UserError(
                unusable_dir_sentence(err)
                or f"{folder.what} {folder.path} cannot be written ({problem}); free space there, or set "
                f"{folder.moved_by} to a folder with room."
            )
        folder.move(out_dir / CACHE_DIR / folder.fallback)
        moved.append((folder, problem))
    if moved and announce:
        print(_moved_line(moved, out_dir / CACHE_DIR), file=sys.stderr, flush=True)


def _moved_line(moved: list[tuple[RunFolder, str]], cache: Path) -> str:
    them = "it" if len(moved) == 1 else "them"
    whats = ", ".join(f"{folder.what} ({folder.path or 'no home'})" for folder, _ in moved)
    problems = "; ".join(dict.fromkeys(problem for _, problem in moved))
    keys = ", ".join(dict.fromkeys(folder.moved_by for folder, _ in moved))
    return (
        f"ditrun: warning: {whats} cannot be written ({problems}); this run keeps {them} in {cache} "
        f"(set {keys} to keep {them} between runs)"
    )


NO_HOME = "HOME is empty or unset, and the password database names no home for this user"


def run_folders(cfg, out_dir: Path, wandb_on: bool) -> list[RunFolder]:
    """The folders a run of ``cfg`` writes, the results directory first."""
    from ditrun.model.folders import is_pipeline_folder

    found = [RunFolder("the results directory", out_dir, "hydra.run.dir (or output_dir)")]
    if cfg.metrics.ssim:
        found.append(_cache(cfg, "metrics.full_quality_dir", "references", "the reference cache"))
    if is_pipeline_folder(cfg.model.path):
        found.append(_cache(cfg, "workload.prompt_cache_dir", "prompts", "the prompt cache"))
    if wandb_on:
        found += [_wandb_folder(variable) for variable in WANDB_FOLDERS]
    if cfg.metrics.report:
        found.append(_env_folder("matplotlib's folder", "MPLCONFIGDIR", ("XDG_CONFIG_HOME", ".config", "matplotlib")))
    return found


def _cache(cfg, key: str, name: str, what: str) -> RunFolder:
    """A ditrun cache: the folder ``key`` names, else ``user_cache.user_cache_dir() / name``; it can move into the
    run directory."""
    section, leaf = key.split(".")

    def move(path: Path) -> None:
        cfg[section][leaf] = str(path)

    if cfg[section][leaf]:
        return RunFolder(what, Path(cfg[section][leaf]), key, name, move)
    return RunFolder(
        what, _under_home("XDG_CACHE_HOME", ".cache", f"ditrun/{name}"), f"{key} (or XDG_CACHE_HOME, HOME)", name, move
    )


def _wandb_folder(variable: str) -> RunFolder:
    return _env_folder(f"W&B's folder {variable}", variable, WANDB_FOLDERS[variable])


def _env_folder(what: str, variable: str, default: tuple[str, str, str]) -> RunFolder:
    """A library's folder that ``variable`` names, else its XDG default; it can move into the run directory."""

    def move(path: Path) -> None:
        os.environ[variable] = str(path)

    fallback = variable.lower().replace("_dir", "")
    if os.environ.get(variable):
        return RunFolder(what, Path(os.environ[variable]), variable, fallback, move)
    xdg = default[0]
    return RunFolder(what, _under_home(*default), f"{variable} (or {xdg}, HOME)", fallback, move)


def _under_home(xdg: str, under_home: str, name: str) -> Optional[Path]:
    """``$xdg/name``, else ``~/under_home/name`` (XDG base directories); None when the user's home is unknown
    (``HOME`` empty, or unset with no home in the password database)."""
    if os.environ.get(xdg):
        return Path(os.environ[xdg]) / name
    try:
        home = Path.home() if os.environ.get("HOME", "unset") else None
    except (RuntimeError, KeyError):
        home = None
    return home / under_home / name if home else None


def _probe(folder: Path) -> Optional[OSError]:
    """Why ``folder`` cannot hold a run's files (made where missing, a byte written, flushed and removed), or None."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f"{files.TEMPORARY_PREFIX}probe.{secrets.token_hex(8)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            files.write_all(fd, b"\n", probe)
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as err:
        return err
    return None


def _why(err: OSError) -> str:
    named = err.filename and files.TEMPORARY_PREFIX not in str(err.filename)  # the probe's name says nothing
    return f"{os.strerror(err.errno)}: {err.filename}" if named else os.strerror(err.errno or errno.EIO)
