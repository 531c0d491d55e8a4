"""Slurm: the sbatch script that runs ditrun with one task per GPU.

``python -m ditrun.launch.slurm --nodes 2 --gpus-per-node 8 --time 02:00:00 --partition gpu``
prints a script to hand to ``sbatch`` (``slurm/ditrun.sbatch`` is the default rendering, checked
by a test). Inside the job, ``srun`` starts every task as a ditrun rank: ranks, local ranks and
the rendezvous (first node, a port derived from the job id) come from Slurm's variables, so the
script needs no set-up of its own. Sweeps go through Hydra's submitit launcher instead
(``ditrun -m hydra/launcher=submitit_slurm hydra.launcher.tasks_per_node=8 ...``), whose tasks
are ranks the same way; see docs/LAUNCH.md.

Requeue: Slurm signals the script ``signal_s`` seconds before the time limit; the script
requeues the job, which keeps its id and therefore its results directory, and the rerun skips
every edit already in ``edits.jsonl``.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import shutil
import string
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ditrun.errors import UserError

TEMPLATE = string.Template("""\
#!/bin/bash
# ditrun on Slurm: ${nodes} node(s) x ${tasks_per_node} task(s), ${per_task}, every task a ditrun rank.
# Rendered by: ${render_command}
# Submit with ditrun overrides as arguments:  sbatch <this file> layout=ulysses workload.limit=8
#SBATCH --job-name=${job_name}
#SBATCH --nodes=${nodes}
#SBATCH --ntasks-per-node=${tasks_per_node}
${resource_lines}#SBATCH --time=${time}
#SBATCH --output=${log}
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@${signal_s}
set -euo pipefail

# One results directory per job id: a requeued job keeps its id, finds its edits.jsonl there
# and skips the edits already finished.
OUT=$${DITRUN_OUTPUT_DIR:-results/slurm-$$SLURM_JOB_ID}
# ditrun by absolute path (the venv's entry point), so a job submitted from a shell without the venv
# on PATH runs as well; DITRUN=... names another (DITRUN="python -m ditrun": the nodes' own python).
DITRUN=$${DITRUN:-${ditrun}}

# USR1 arrives ${signal_s} s before the time limit: requeue (the running step is stopped).
trap 'echo "ditrun: time limit near, requeueing job $$SLURM_JOB_ID"; scontrol requeue "$$SLURM_JOB_ID"' USR1

# A failed task ends the whole step at once instead of leaving the others waiting for it.
srun --kill-on-bad-exit=1 $$DITRUN hydra.run.dir="$$OUT"${ditrun_args} "$$@" &
wait $$!
""")


@dataclass
class SbatchParams:
    """What the sbatch script asks Slurm for."""

    nodes: int = 1
    gpus_per_node: int = 8
    tasks_per_node: Optional[int] = None
    """Ranks per node; one per GPU unless given (CPU-only nodes must give it)."""
    time: str = "01:00:00"
    partition: Optional[str] = None
    cpus_per_task: Optional[int] = None
    job_name: str = "ditrun"
    log: str = "results/slurm-%j.out"
    """sbatch's ``--output``: beside the job's results directory, under ``results/`` (a folder git ignores, which
    exists in the repository; Slurm makes no folder for it)."""
    ditrun: str = "$SLURM_SUBMIT_DIR/.venv/bin/ditrun"
    """The ``ditrun`` the job runs: the repository's venv when submitted from its root; ``python -m
    ditrun.launch.slurm`` writes the absolute path of the venv it runs in."""
    signal_s: int = 120
    """Seconds before the time limit at which the job requeues itself."""
    ditrun_args: list[str] = field(default_factory=list)
    """ditrun overrides baked into the script (more can follow on the sbatch command line)."""


def check_params(params: SbatchParams) -> None:
    if params.nodes < 1:
        raise UserError(f"--nodes={params.nodes} must be at least 1.")
    if params.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node={params.gpus_per_node} must be 0 (CPU nodes) or more.")
    if params.gpus_per_node == 0 and not params.tasks_per_node:
        raise UserError("--gpus-per-node=0 needs --tasks-per-node: there is no GPU to count tasks by.")
    if params.tasks_per_node is not None and params.gpus_per_node and params.tasks_per_node != params.gpus_per_node:
        raise UserError(
            f"--tasks-per-node={params.tasks_per_node} differs from --gpus-per-node={params.gpus_per_node}; "
            "ditrun runs one task per GPU."
        )


def render_sbatch(params: SbatchParams, render_args: str = "") -> str:
    """The sbatch script for ``params``."""
    check_params(params)
    resources = []
    if params.gpus_per_node:
        resources.append(f"--gpus-per-node={params.gpus_per_node}")
    if params.cpus_per_task:
        resources.append(f"--cpus-per-task={params.cpus_per_task}")
    if params.partition:
        resources.append(f"--partition={params.partition}")
    return TEMPLATE.substitute(
        per_task="one GPU per task" if params.gpus_per_node else "CPU only",
        nodes=params.nodes,
        tasks_per_node=params.tasks_per_node or params.gpus_per_node,
        resource_lines="".join(f"#SBATCH {line}\n" for line in resources),
        time=params.time,
        log=params.log,
        ditrun=params.ditrun,
        job_name=params.job_name,
        signal_s=params.signal_s,
        render_command=" ".join(["python -m ditrun.launch.slurm", render_args]).strip(),
        ditrun_args="".join(" " + shlex.quote(arg) for arg in params.ditrun_args),
    )


def refused_submission(err: BaseException) -> Optional[str]:
    """The sentence for a sweep whose jobs sbatch refused (submitit raises its error, with sbatch's own lines, from
    the failed ``sbatch`` command), None for any other error. Nothing ran: the sweep folder it leaves is removed."""
    cause = err
    while cause is not None and not _is_sbatch_failure(cause):
        cause = cause.__cause__
    if cause is None:
        return None
    lines = [line.strip() for line in (cause.stderr or "").splitlines() if line.strip()]
    reason = "; ".join(line.removeprefix("sbatch: ").removeprefix("error: ") for line in lines)
    removed = _remove_unrun_sweep(Path(cause.cmd[-1]))
    return (
        f"sbatch refused the sweep's jobs ({reason or f'exit status {cause.returncode}'}), so none ran{removed}; "
        "they ask for what the launcher's config says (hydra.launcher.gpus_per_node, partition, ...: "
        "ditrun/conf/hydra/launcher/)."
    )


class SacctWarnedOnce(logging.Filter):
    """submitit polls ``sacct`` for its jobs' states and warns at every poll that fails (a cluster without Slurm's
    accounting): one sentence, the first time, instead of a warning per poll and per log handler."""

    def __init__(self):
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Bypassing sacct error" not in message:
            return True
        if not self.said:
            self.said = True
            error = message.split("Bypassing sacct error ", 1)[1].removesuffix(", status may be inaccurate.")
            print(
                f"ditrun: warning: sacct cannot say how the sweep's jobs are doing ({error}); submitit follows them "
                "without it, their states perhaps late (said once).",
                file=sys.stderr,
                flush=True,
            )
        return False


def warn_of_sacct_once() -> None:
    """Install ``SacctWarnedOnce`` on submitit's logger (once per process)."""
    submitit_logger = logging.getLogger("submitit")
    if not any(isinstance(f, SacctWarnedOnce) for f in submitit_logger.filters):
        submitit_logger.addFilter(SacctWarnedOnce())


def _is_sbatch_failure(err: BaseException) -> bool:
    return isinstance(err, subprocess.CalledProcessError) and bool(err.cmd) and Path(err.cmd[0]).name == "sbatch"


def _remove_unrun_sweep(submission: Path) -> str:
    """Remove the sweep folder of a refused submission when it holds only what the submission wrote (Hydra's
    ``multirun.yaml``, submitit's pickled jobs and sbatch script); the words saying so, or ""."""
    folder = submission.parent
    sweep = folder.parent
    if folder.name != ".submitit" or sweep.is_symlink() or folder.is_symlink() or not folder.is_dir():
        return ""
    written = all(p.suffix == ".pkl" or p.name.startswith(".submission_file_") for p in folder.iterdir())
    if not written or any(p.name not in (".submitit", "multirun.yaml") for p in sweep.iterdir()):
        return ""
    shutil.rmtree(sweep)
    return f" and the sweep's folder {sweep}, which held nothing else, is removed"


def venv_entry_point() -> Path:
    """The ``ditrun`` script of the environment this Python runs in (a venv's ``bin/``), absolute."""
    return Path(sys.prefix).absolute() / "bin" / "ditrun"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ditrun.launch.slurm", description="Print an sbatch script that runs ditrun, one task per GPU."
    )
    defaults = SbatchParams()
    parser.add_argument("--nodes", type=int, default=defaults.nodes)
    parser.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node)
    parser.add_argument("--tasks-per-node", type=int, default=None, help="only for CPU nodes (--gpus-per-node 0)")
    parser.add_argument("--time", default=defaults.time)
    parser.add_argument("--partition", default=None)
    parser.add_argument("--cpus-per-task", type=int, default=None)
    parser.add_argument("--job-name", default=defaults.job_name)
    parser.add_argument("--log", default=defaults.log, help="sbatch --output pattern")
    parser.add_argument("--signal-s", type=int, default=defaults.signal_s)
    parser.add_argument(
        "--ditrun", default=str(venv_entry_point()), help="the ditrun the job runs (default: this venv's, by path)"
    )
    parser.add_argument("-o", "--output", default=None, help="write the script here instead of printing it")
    parser.add_argument("ditrun_args", nargs="*", help="ditrun overrides baked into the script")
    return parser


def _without_output(argv: list[str]) -> list[str]:
    """The command line minus ``-o FILE``, for the script's "Rendered by" line."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("-o", "--output"):
            skip = True
        elif not arg.startswith("--output="):
            kept.append(arg)
    return kept


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    params = SbatchParams(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        time=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        job_name=args.job_name,
        log=args.log,
        signal_s=args.signal_s,
        ditrun=args.ditrun,
        ditrun_args=args.ditrun_args,
    )
    try:
        script = render_sbatch(params, render_args=" ".join(shlex.quote(a) for a in _without_output(argv)))
    except UserError as err:
        print(f"ditrun: error: {err}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as out:
            out.write(script)
    else:
        sys.stdout.write(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
