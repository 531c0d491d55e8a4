"""Hydra's submitit launchers for ditrun's sweeps, where a job that ends without a result is a failed job of the sweep.

``ditrun/conf/hydra/launcher/local.yaml`` and ``slurm.yaml`` take the submitit plugin's configs (every
``hydra.launcher.*`` key it knows) and point ``_target_`` here. The job itself is the plugin's: each job calls
``BaseSubmititLauncher.__call__`` (Hydra's ``run_job`` with the job's overrides) and requeues through its
``checkpoint``. What differs is how the sweep's process collects the jobs. The plugin reads each job's result with
submitit's ``Job.results()``, which raises ``UncompletedJobError`` for a job that wrote none, and that error ends the
whole sweep with a traceback, before its report (or, where Slurm has no accounting for submitit to follow a job by,
never ends it). A job writes no result when it is killed (SIGKILL, the OOM killer, ``scancel``, a lost node, a crash in
native code) or exits on its own (ditrun's exits for a user's mistake, 2, and a stop signal, 128 + N): a Python error
inside it is caught by ditrun's task function instead, which notes it under the sweep
(``ditrun.metrics.report.note_failed_job``). Here a job without its result is noted the same way, from the sweep's
process: one line naming it (its overrides, how it ended: its state and the last line of its log), the sweep's report
lists it as incomplete, and the command exits 1 at the end.

Its result stays a completed ``JobReturn``: Hydra's basic sweeper re-raises the error of a ``FAILED`` one as soon as
the jobs of a batch have ended, and Hydra then skips ``on_multirun_end``, where ditrun's sweep report is written.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)

# The most of a job's log read for its last line (a progress bar's carriage returns make long lines).
LOG_TAIL_BYTES = 8192
# The most of that line a failed job's one line quotes.
LOG_LINE_CHARS = 240


class _Launcher(BaseSubmititLauncher):
    """The jobs of a batch submitted as one submitit array; the results collected in order, each job that wrote none
    noted as failed."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and job_overrides
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:  # hydra.sweep.mode: the folder's permissions, in octal
            os.chmod(sweep_dir, int(str(self.config.hydra.sweep.mode), 8))
        numbers = [initial_job_idx + i for i in range(len(job_overrides))]
        log.info(f"Launching {len(numbers)} jobs through submitit ({self._EXECUTOR}) into {sweep_dir}")
        for number, overrides in zip(numbers, job_overrides):
            log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
        state = Singleton.get_state()
        jobs = self._executor().map_array(
            self,  # each job runs BaseSubmititLauncher.__call__ with one value of each list below
            [list(overrides) for overrides in job_overrides],
            ["hydra.sweep.dir"] * len(numbers),
            numbers,
            [f"job_id_for_{number}" for number in numbers],
            [state] * len(numbers),
        )
        return [self._result(job, list(o), n) for job, o, n in zip(jobs, job_overrides, numbers)]

    def _executor(self):
        """A submitit executor with this launcher's parameters under submitit's names: the keys every queue shares
        (``BaseQueueConf``) as they are, the others prefixed with the executor's name (``slurm_partition``);
        ``max_num_timeout`` goes to the executor's constructor."""
        import submitit

        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        params = {key: value for key, value in self.params.items() if key != "submitit_folder"}
        named = {key if key in shared else f"{self._EXECUTOR}_{key}": value for key, value in params.items()}
        limit_key = f"{self._EXECUTOR}_max_num_timeout"
        limit = {limit_key: named.pop(limit_key)} if limit_key in named else {}
        executor = submitit.AutoExecutor(folder=self.params["submitit_folder"], cluster=self._EXECUTOR, **limit)
        executor.update_parameters(**named)
        return executor

    def _result(self, job, overrides: list[str], number: int) -> JobReturn:
        """The job's own result, or, when it ended without one, a result for it once it is noted as failed."""
        state = self._ended(job)
        if self._written(job, state):
            return job.results()[0]  # task 0's, as every task runs the same Hydra job
        folder, task_overrides = self._job_folder(overrides, number)
        from ditrun.metrics.report import note_failed_job

        why = how_it_ended(job, state)
        note_failed_job(Path(str(self.config.hydra.sweep.dir)), folder, number, task_overrides, why)
        return JobReturn(
            overrides=overrides,
            working_dir=str(folder),
            task_name=str(self.config.hydra.job.name),
            status=JobStatus.COMPLETED,
            _return_value=None,
        )

    def _ended(self, job) -> str:
        """Wait until the job has ended; its state then."""
        job.wait()
        return job.state

    def _written(self, job, state: str) -> bool:
        """Whether every task of the ended job wrote its result. Those of a local job ran on this machine: a result
        not there now never comes."""
        return results_written(job)

    def _job_folder(self, overrides: list[str], number: int) -> tuple[Path, list[str]]:
        """The job's run directory and its overrides (``hydra.overrides.task``), as the job itself has them: its
        config composed again here, as Hydra composes it in the job (``run_job``)."""
        assert self.hydra_context is not None and self.config is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config.hydra.job):
            config.hydra.job.num = number
        sweep_hydra = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(config)  # a hydra:... resolver in hydra.sweep.subdir reads this job's
        try:
            folder = Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / str(
                OmegaConf.select(config, "hydra.sweep.subdir")
            )
        finally:
            HydraConfig.instance().cfg = sweep_hydra
        return folder.absolute(), [str(o) for o in config.hydra.overrides.task]


class LocalLauncher(_Launcher):
    """``hydra/launcher=local``: the jobs as processes of this machine (submitit's local executor)."""

    _EXECUTOR = "local"


class SlurmLauncher(_Launcher):
    """``hydra/launcher=slurm``: the jobs as one Slurm job array (submitit's Slurm executor)."""

    _EXECUTOR = "slurm"

    def _ended(self, job) -> str:
        # submitit learns that a job ended from its result or from sacct; on a cluster without Slurm's accounting
        # (sacct fails) a job that ended without a result would be waited for forever, so the controller is asked too.
        asked = -POLL_S
        while not job.done():
            if time.monotonic() - asked >= POLL_S:
                asked, state = time.monotonic(), controller_state(job.job_id)
                if state in ENDED:
                    return state
            time.sleep(1)
        return job.state

    def _written(self, job, state: str) -> bool:
        # A shared file system may show a result written on another node late: waited for as submitit does, unless
        # Slurm says the job did not finish.
        deadline = time.monotonic() + (0 if state.split(" ")[0] in UNFINISHED else RESULT_WAIT_S)
        while not results_written(job):
            if time.monotonic() >= deadline:
                return False
            time.sleep(1)
        return True


# Slurm's states of a job that ended without finishing (sacct's CANCELLED says "by <uid>" after it).
UNFINISHED = frozenset({"BOOT_FAIL", "CANCELLED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"})
ENDED = UNFINISHED | {"COMPLETED", "PURGED"}
# Seconds between two questions to Slurm's controller about a job that sacct cannot follow.
POLL_S = 5.0
# The most seconds a result is waited for once its job completed (submitit's own wait, ``Job.results``).
RESULT_WAIT_S = 15.0


def controller_state(job_id: str) -> str:
    """The job's state as Slurm's controller has it (``scontrol show job``), "" when it cannot say; PURGED when it
    no longer knows the job, which therefore ended more than ``MinJobAge`` ago."""
    try:
        shown = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    if shown.returncode != 0:
        return "PURGED" if "Invalid job id" in shown.stderr else ""
    fields = dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)
    return fields.get("JobState", "")


def results_written(job) -> bool:
    return all(job.task(k).paths.result_pickle.exists() for k in range(job.num_tasks))


def how_it_ended(job, state: str) -> str:
    """One line saying how a job that wrote no result ended: which of its tasks wrote none, its state (submitit's,
    or Slurm's controller's), and the last line of that task's log."""
    silent = [k for k in range(job.num_tasks) if not job.task(k).paths.result_pickle.exists()] or [0]
    tasks = "" if job.num_tasks == 1 else f" (task {', '.join(map(str, silent))} of {job.num_tasks})"
    why = (
        f"submitit job {job.job_id}{tasks} ended without a result (state: {state}): it exited early or was killed "
        "(SIGKILL, the OOM killer, scancel, a lost node)"
    )
    paths = job.task(silent[0]).paths
    for path in (paths.stderr, paths.stdout):
        line = last_line(path)
        if line:
            return f"{why}; its log {path} ends: {line}"
    return why


def last_line(path: Path) -> str:
    """The last non-empty line of a log (after its last carriage return), cut to ``LOG_LINE_CHARS``; "" when there is
    none or it cannot be read."""
    try:
        with open(path, "rb") as log_file:
            log_file.seek(max(0, os.fstat(log_file.fileno()).st_size - LOG_TAIL_BYTES))
            tail = log_file.read(LOG_TAIL_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.rsplit("\r", 1)[-1].strip() for line in tail.splitlines()]
    line = next((line for line in reversed(lines) if line), "")
    return line if len(line) <= LOG_LINE_CHARS else line[: LOG_LINE_CHARS - 3] + "..."
