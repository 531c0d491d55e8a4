"""The run directories a report reads, and what may be said of each: complete or not, and comparable with which.

Only ditrun's own files are read (``run.json``, ``summary.json``, ``edits.jsonl`` and Hydra's
``.hydra/overrides.yaml``), so no W&B is needed. A run directory is one holding ``run.json`` (written when a run
claims it) or ``summary.json``; one whose run never wrote a summary is listed, not dropped.

A verdict comes from a complete run only: every edit ``run.json`` declares is recorded, and the last run that
claimed the directory wrote the summary (``run_id`` matches): a run that crashed or was killed after an earlier
one finished leaves that earlier summary behind, which must not speak for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from ditrun.errors import UserError
from ditrun.results.files import (
    RUN_FILE,
    SUMMARY_FILE,
    WANDB_DIR,
    Refused,
    finished_edits,
    parse_json,
    read_bytes,
)

COMPLETE = "complete"
INCOMPLETE = "incomplete"
UNREADABLE = "unreadable"
# Model keys that change how fast the model runs, never its pictures.
MODEL_SPEED_KEYS = ("compile", "compile_backend", "fuse", "compile_tuning", "cuda_graphs")
# Workload keys a run may trade for speed (the reference keeps its own: ``full_quality.TRADED``), or that do not
# change the pictures.
WORKLOAD_FREE_KEYS = ("steps", "true_cfg_scale", "prompt_cache_dir", "manifest")
OVERRIDES_CAP = 1 << 20  # bytes of Hydra's overrides.yaml read at most (a command line's worth)


@dataclass
class RunResult:
    """What the report knows of one run directory."""

    path: Path
    label: str
    summary: dict
    records: list[dict]
    overrides: list[str] = field(default_factory=list)
    run_file: dict = field(default_factory=dict)
    status: str = COMPLETE
    reason: Optional[str] = None
    """Why the run is not complete (or cannot be read), in words."""

    @property
    def config(self) -> dict:
        """The run's resolved config: the summary's, else the settings ``run.json`` recorded."""
        return self.summary.get("config") or self.run_file.get("settings") or {}

    def setting(self, key: str):
        """``layout`` / ``transport`` / ``world`` as the run's config had it; ``precision`` as it ran."""
        if key == "precision" and "precision" in self.summary:
            return self.summary["precision"]
        if key == "world":
            return self.config.get("launcher", {}).get("world")
        return self.config.get(key, {}).get("name")

    @property
    def dit_s(self) -> Optional[float]:
        return _number(self.summary.get("dit_s_median"))

    @property
    def exposed_s(self) -> float:
        return _number(self.summary.get("exposed_transfer_s_median")) or 0.0

    @property
    def complete(self) -> bool:
        return self.status == COMPLETE


def _number(value) -> Optional[float]:
    """``value`` when it is a number (a file of another origin may hold anything there), else None."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def find_runs(root: Path) -> tuple[list[Path], dict[Path, str]]:
    """(``root`` itself when it is a run directory, else every run directory below it, sweep jobs in order; the
    folders below it that cannot be listed, with why). Symbolic links are not followed, W&B's folders not entered."""
    if _is_run(root):
        return [root], {}
    found, unlisted, folders = set(), {}, [root]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name in (SUMMARY_FILE, RUN_FILE):
                        found.add(folder)
                    elif entry.is_dir(follow_symlinks=False) and entry.name != WANDB_DIR:
                        folders.append(Path(entry.path))
        except OSError as err:
            unlisted[folder] = f"cannot be listed ({err.strerror})"
    return sorted(found, key=lambda p: _sort_key(p, root)), unlisted


def _sort_key(path: Path, root: Path) -> list:
    return [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in path.relative_to(root).parts]


def _is_run(path: Path) -> bool:
    return any(os.path.lexists(path / name) for name in (SUMMARY_FILE, RUN_FILE))


def _read_json(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the JSON object in ``path``, None), (None, None) when there is no such file, or (None, what is wrong): a
    file that is not a regular one of this tree, too large, or not JSON ditrun writes is never read or parsed."""
    try:
        text = read_bytes(path)
    except Refused as err:
        return None, err.short
    except OSError as err:
        return None, f"{path.name} cannot be read ({err.strerror})"
    if not text:
        return None, None if not os.path.lexists(path) else f"{path.name} is empty"
    data = parse_json(text)
    return (data, None) if isinstance(data, dict) else (None, f"{path.name} is not a JSON object ditrun writes")


def _overrides(path: Path) -> list[str]:
    """The run's command-line overrides (Hydra's list of strings); anything else there is left out."""
    try:
        data = yaml.safe_load(read_bytes(path / ".hydra" / "overrides.yaml", OVERRIDES_CAP))
    except (OSError, UserError, ValueError, RecursionError, yaml.YAMLError):
        return []
    return [o for o in data if isinstance(o, str)] if isinstance(data, list) else []


def load_run(path: Path, root: Path) -> RunResult:
    """One run directory, with its status; a file it cannot read makes it ``unreadable``, never an exception."""
    label = str(path.relative_to(root)) if path != root else path.name
    summary, summary_problem = _read_json(path / SUMMARY_FILE)
    run_file, run_problem = _read_json(path / RUN_FILE)
    try:
        records = list(finished_edits(path).values())
    except Refused as err:
        return _unreadable(path, label, err.short)
    except OSError as err:
        return _unreadable(path, label, f"its records cannot be read ({err.strerror})")
    run = RunResult(path, label, summary or {}, records, _overrides(path), run_file or {})
    problem = summary_problem or run_problem
    if problem:
        run.status, run.reason = UNREADABLE, problem
    else:
        try:
            run.status, run.reason = _status(run)
        except (TypeError, ValueError, AttributeError) as err:  # values of the wrong kind in its files
            run.status, run.reason = UNREADABLE, f"its files hold values ditrun does not write ({err})"
    return run


def _unreadable(path: Path, label: str, reason: str) -> RunResult:
    return RunResult(path, label, {}, [], status=UNREADABLE, reason=reason)


def _status(run: RunResult) -> tuple[str, Optional[str]]:
    declared = run.run_file.get("edits") or []
    recorded = {r.get("edit") for r in run.records}
    missing = [edit for edit in declared if edit not in recorded]
    if not run.summary:
        return (
            INCOMPLETE,
            f"no summary: its run did not finish ({len(declared) - len(missing)} of {len(declared)} edits)",
        )
    started = run.run_file.get("run_id")
    if started and run.summary.get("run_id") != started:
        return INCOMPLETE, (
            "its last run wrote no summary (it is running, or crashed or was killed); the summary "
            "there is an earlier run's"
        )
    if run.summary.get("stopped"):
        return INCOMPLETE, f"stopped: {run.summary['stopped']}"
    if missing or run.summary.get("complete") is False:
        edits = len(declared) if declared else run.summary.get("edits")
        return INCOMPLETE, f"{len(declared) - len(missing) if declared else len(recorded)} of {edits} edits recorded"
    return COMPLETE, None


def _with_failures(runs: list[RunResult], root: Path, failed: dict[Path, tuple[list[str], str]]) -> list[RunResult]:
    found = {run.path: run for run in runs}
    for path, (overrides, why) in failed.items():
        path = Path(path)
        run = found.get(path)
        if run is None and path.is_relative_to(root):
            run = RunResult(path, str(path.relative_to(root)), {}, [], list(overrides))
            runs.append(run)
        if run is not None:
            run.status, run.reason = INCOMPLETE, f"its job failed: {why}"
    return sorted(runs, key=lambda run: _sort_key(run.path, root))


def label_with_overrides(runs: list[RunResult]) -> None:
    """Append to each label the overrides that tell the runs apart (those not shared by all)."""
    shared = set.intersection(*(set(r.overrides) for r in runs)) if runs else set()
    for run in runs:
        distinct = [o for o in run.overrides if o not in shared]
        if distinct:
            run.label = f"{run.label}: {' '.join(distinct)}"


def load_runs(root: Path, failed: Optional[dict[Path, tuple[list[str], str]]] = None) -> list[RunResult]:
    """Every run under ``root``, labelled by the overrides that tell them apart; one sentence if there is none.

    ``failed`` (a sweep's jobs that failed: directory -> (overrides, why)) are listed as incomplete with why, found
    in the tree or not (a job that failed before it claimed its directory left no file there)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; give a ditrun run or multirun directory.")
    paths, unlisted = find_runs(root)
    if root in unlisted:
        raise UserError(f"{root} cannot be read ({unlisted[root]}).")
    runs = [load_run(p, root) for p in paths]
    runs += [_unreadable(p, str(p.relative_to(root)), why) for p, why in unlisted.items()]
    runs = _with_failures(runs, root, failed or {})
    if not runs:
        raise UserError(f"{root} holds no ditrun run (no {SUMMARY_FILE} or {RUN_FILE} in it or below it).")
    label_with_overrides(runs)
    return runs


def comparable_key(run: RunResult) -> dict:
    """What two runs must share for one to be judged beside the other: the model and its weights (not how fast it
    runs), the workload (less what a run may trade), and the full-quality reference they are graded against."""
    config = run.config
    model = {k: v for k, v in config.get("model", {}).items() if k not in MODEL_SPEED_KEYS}
    workload = {k: v for k, v in config.get("workload", {}).items() if k not in WORKLOAD_FREE_KEYS}
    workload["edits"] = run.run_file.get("settings", {}).get("workload", {}).get("edits")  # as declared
    metrics = config.get("metrics", {})
    reference = {
        **(run.summary.get("reference") or {}),
        "dtype": metrics.get("full_quality_dtype") or metrics.get("reference_dtype"),  # the key's old name too
        "device": run.summary.get("device"),
    }
    return {"model": model, "workload": workload, "reference": reference}
