"""Where ranks run: in this process, spawned locally, or as ranks of an external launcher.

``launch`` decides once, from the environment and ``launcher.world``:

- started by torchrun, ``srun``, ``mpiexec``/``mpirun`` or submitit with more than one rank:
  this process is one rank; it joins the others and runs the work;
- otherwise, ``launcher.world`` > 1: spawn that many ranks on this machine (``spawn.py``); each
  is started torchrun-style and takes the path above;
- otherwise: run the work in this process, with no process group at all.

The work is handed in (``work.py``: ditrun's is ``ditrun.run.WORK``, the config's checks and ``worker.run``);
this package knows nothing else of the run. Every rank reaches ``work.run(cfg, out_dir, job, nodes)`` the same
way: device bound, the rendezvous met (ranks that never arrive are named), the placement printed once and checked
(an SP group on several nodes is refused, ``parallel/placement.py``), ``torch.distributed`` initialised (gloo on
CPUs, nccl on GPUs), the same results directory as rank 0, a watchdog that ends the rank when another one fails,
stop signals caught (``stop.py``) and its parent watched, and ``job`` (``job.py``) to share rank 0's decisions,
stop together and end the run together, with a heartbeat by which a failing rank tells a lost node (named) from
its own error. ``STARTUP`` times the way there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ditrun.launch import env
from ditrun.launch.faults import WorkerFailed  # noqa: F401  (the package's API)
from ditrun.launch.job import LocalJob
from ditrun.launch.rank import check_placement, run_as_rank, with_world  # noqa: F401  (the package's API)
from ditrun.launch.stop import process_stop
from ditrun.launch.work import Work
from ditrun.results import rundir
from ditrun.timers import STARTUP


def launch(cfg, out_dir: Path, work: Work, hydra_files: Optional[rundir.HydraFiles] = None) -> Optional[dict]:
    """Run ``work`` for the job described by ``cfg`` with results in ``out_dir``; returns the summary on rank 0.

    ``hydra_files`` reach global rank 0, which writes them once the directory is this run's."""
    STARTUP.start_job()
    info = env.discover()
    if info is not None and info.world > 1:
        return run_as_rank(cfg, out_dir, info, work, hydra_files=hydra_files)
    work.check(cfg, cfg.launcher.world)
    rundir.make_run_dir(out_dir)  # a file in its place is one sentence before any rank starts
    if cfg.launcher.world > 1:
        from ditrun.launch import spawn

        return spawn.spawn_local(cfg, out_dir, work, hydra_files)
    stop = process_stop().install()
    try:
        return work.run(cfg, out_dir, LocalJob(stop), hydra_files=hydra_files)
    finally:
        stop.restore()
