"""The run directories a report reads, and what may be said of each: complete or not, and comparable with which.

Only ditrun's own files are read (``run.json``, ``summary.json``, ``edits.jsonl`` and Hydra's
``.hydra/overrides.yaml``), so no W&B is needed. A run directory is one holding ``run.json`` (written when a run
claims it) or ``summary.json``; one whose run never wrote a summary is listed, not dropped.

A verdict comes from a complete run only: every edit ``run.json`` declares is recorded, and the last run that
claimed the directory wrote the summary (``run_id`` matches): a run that crashed or was killed after an earlier
one finished leaves that earlier summary behind, which must not speak for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from ditrun.errors import UserError
from ditrun.results.files import RUN_FILE, SUMMARY_FILE, finished_edits

COMPLETE = "complete"
INCOMPLETE = "incomplete"
UNREADABLE = "unreadable"
# Model keys that change how fast the model runs, never its pictures.
MODEL_SPEED_KEYS = ("compile", "compile_backend", "fuse", "compile_tuning", "cuda_graphs")
# Workload keys a run may trade for speed (the reference keeps its own: ``full_quality.TRADED``), or that do not
# change the pictures.
WORKLOAD_FREE_KEYS = ("steps", "true_cfg_scale", "prompt_cache_dir", "manifest")


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
        return self.summary.get("dit_s_median")

    @property
    def exposed_s(self) -> float:
        return self.summary.get("exposed_transfer_s_median") or 0.0

    @property
    def complete(self) -> bool:
        return self.status == COMPLETE


def find_runs(root: Path) -> list[Path]:
    """``root`` itself when it is a run directory, else every run directory below it, sweep jobs in order."""
    if _is_run(root):
        return [root]
    found = {
        p.parent
        for name in (SUMMARY_FILE, RUN_FILE)
        for p in root.rglob(name)
        if "wandb" not in p.relative_to(root).parts
    }
    return sorted(
        found, key=lambda p: [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.relative_to(root).parts]
    )


def _is_run(path: Path) -> bool:
    return (path / SUMMARY_FILE).is_file() or (path / RUN_FILE).is_file()


def _read_json(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the JSON object in ``path``, None), (None, None) when there is no such file, or (None, what is wrong)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"{path.name} cannot be read ({type(err).__name__})"
    return (data, None) if isinstance(data, dict) else (None, f"{path.name} is not a JSON object")


def _overrides(path: Path) -> list[str]:
    try:
        return [str(o) for o in yaml.safe_load((path / ".hydra" / "overrides.yaml").read_text()) or []]
    except (OSError, yaml.YAMLError, TypeError):
        return []


def load_run(path: Path, root: Path) -> RunResult:
    """One run directory, with its status; a file it cannot read makes it ``unreadable``, never an exception."""
    label = str(path.relative_to(root)) if path != root else path.name
    summary, summary_problem = _read_json(path / SUMMARY_FILE)
    run_file, run_problem = _read_json(path / RUN_FILE)
    try:
        records = list(finished_edits(path).values())
    except OSError as err:
        return RunResult(path, label, {}, [], status=UNREADABLE, reason=f"its records cannot be read ({err.strerror})")
    run = RunResult(path, label, summary or {}, records, _overrides(path), run_file or {})
    problem = summary_problem or run_problem
    if problem:
        run.status, run.reason = UNREADABLE, problem
    else:
        run.status, run.reason = _status(run)
    return run


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


def label_with_overrides(runs: list[RunResult]) -> None:
    """Append to each label the overrides that tell the runs apart (those not shared by all)."""
    shared = set.intersection(*(set(r.overrides) for r in runs)) if runs else set()
    for run in runs:
        distinct = [o for o in run.overrides if o not in shared]
        if distinct:
            run.label = f"{run.label}: {' '.join(distinct)}"


def load_runs(root: Path) -> list[RunResult]:
    """Every run under ``root``, labelled by the overrides that tell them apart; one sentence if there is none."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; give a ditrun run or multirun directory.")
    try:
        paths = find_runs(root)
    except OSError as err:
        raise UserError(f"{root} cannot be read ({err.strerror}: {err.filename}).") from None
    runs = [load_run(p, root) for p in paths]
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
    reference = {
        **(run.summary.get("reference") or {}),
        "dtype": config.get("metrics", {}).get("reference_dtype"),
        "device": run.summary.get("device"),
    }
    return {"model": model, "workload": workload, "reference": reference}
