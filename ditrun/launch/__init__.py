"""Where workers run: in this process, spawned locally, or as ranks of an external launcher.

``launch`` decides once, from the environment and ``launcher.world``:

- started by torchrun, ``srun``, ``mpiexec``/``mpirun`` or submitit with more than one rank:
  this process is one rank; it joins the others and runs the worker;
- otherwise, ``launcher.world`` > 1: spawn that many ranks on this machine (``spawn.py``); each
  is started torchrun-style and takes the path above;
- otherwise: run the worker in this process, with no process group at all.

Every rank reaches ``worker.run(cfg, out_dir, job, nodes)`` the same way: device bound, the rendezvous
met (ranks that never arrive are named), the placement printed once and checked (an SP group on
several nodes is refused, ``parallel/placement.py``), ``torch.distributed`` initialised (gloo on CPUs, nccl
on GPUs), the same results directory as rank 0, a watchdog that ends the rank when another
one fails, stop signals caught (``stop.py``) and its parent watched, and ``job`` (``job.py``)
to share rank 0's decisions, stop together and end the run together, with a heartbeat by which
a failing rank tells a lost node (named) from its own error. ``STARTUP`` times the way there.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ditrun import workload
from ditrun.launch import env, faults, rendezvous, worker
from ditrun.launch.job import LocalJob, StoreJob
from ditrun.launch.stop import RunStopped, process_stop
from ditrun.metrics.timing import STARTUP
from ditrun.model.build import model_geometry
from ditrun.parallel.layout import LayoutPlan
from ditrun.parallel.placement import Placement
from ditrun.errors import UserError


class WorkerFailed(RuntimeError):
    """A rank of this job failed; the message names it. (User mistakes are ``UserError``s instead.)"""


def launch(cfg, out_dir: Path) -> Optional[dict]:
    """Run the job described by ``cfg`` with results in ``out_dir``; returns the summary on rank 0."""
    STARTUP.at_age("imports_s")
    info = env.discover()
    if info is not None and info.world > 1:
        return run_as_rank(cfg, out_dir, info)
    check_config(cfg, cfg.launcher.world)
    if cfg.launcher.world > 1:
        from ditrun.launch import spawn

        return spawn.spawn_local(cfg, out_dir)
    stop = process_stop().install()
    try:
        return worker.run(cfg, out_dir, LocalJob(stop))
    finally:
        stop.restore()


def check_config(cfg, world: int) -> LayoutPlan:
    """Everything a user can get wrong, checked on ``world`` ranks before any process starts."""
    # The workload's numbers first: the fault injection's step is checked against workload.steps.
    workload.check_config(cfg.workload)
    check_launcher_config(cfg, world)
    return worker.check_config(cfg, world)


def check_launcher_config(cfg, world: int) -> None:
    """Launcher settings a user can get wrong."""
    launcher = cfg.launcher
    if world < 1:
        raise UserError(f"launcher.world={world} must be at least 1.")
    for key in ("rendezvous_timeout_s", "collective_timeout_s", "stop_timeout_s"):
        if not 0 < getattr(launcher, key) < math.inf:
            raise UserError(f"launcher.{key}={getattr(launcher, key)} must be a positive number of seconds.")
    if launcher.master_port is not None and not 1 <= launcher.master_port <= 65535:
        raise UserError(f"launcher.master_port={launcher.master_port} is not a TCP port; allowed: 1 to 65535.")
    faults.check_fault_config(launcher.fault, world, cfg.workload.steps)


def run_as_rank(cfg, out_dir: Path, info: env.RankInfo, work=None) -> Optional[dict]:
    """Join the job as the rank the launcher started, run ``work`` (the worker) and sign out."""
    work = work or worker.run
    cfg = with_world(cfg, info)
    plan = check_config(cfg, info.world)
    info = env.with_address(info, cfg.launcher.master_port)
    device = rendezvous.bind_device(cfg.device, info.local_rank, info.local_world)
    STARTUP.begin("rendezvous_s")
    meeting = rendezvous.meet(info, cfg.launcher.rendezvous_timeout_s, {"out_dir": str(out_dir)})
    backend = rendezvous.backend_for(cfg.device)
    placement = Placement(plan, meeting.nodes)
    if info.rank == 0:
        print(f"ditrun: {info.world} ranks on {len(placement.ranks_by_node())} node(s) ({info.launcher}) met at "
              f"{meeting.address}; {backend}, rank 0 on {device}\n{placement.describe()}", flush=True)
    check_placement(cfg, placement, info)
    stop = process_stop().install()
    stop.watch_parent(cfg.launcher.stop_timeout_s, f"rank {info.rank}")
    stopped = summary = None
    job = StoreJob(meeting.store, info.rank, info.world, stop, cfg.launcher.collective_timeout_s,
                   meeting.host).start_heartbeat()
    try:
        rendezvous.init_process_group(info, backend, meeting, cfg.launcher.collective_timeout_s)
        STARTUP.end("rendezvous_s")
        watchdog = faults.Watchdog(meeting, info.rank).start()
        summary = work(cfg, Path(meeting.shared["out_dir"]), job, placement.nodes)
    except RunStopped as err:
        stopped = err  # not a failure: the run ends as a good one does, then says it was stopped
    except BaseException as err:
        # A lost node's ranks surface here as some collective's error: report them, not it.
        failure = job.explain(err)
        job.report(failure)
        if failure is not err:
            raise failure from err
        raise
    finally:
        # The heartbeat first: it may signal this process's main thread while the handlers are ours.
        job.stop_heartbeat()
        stop.restore()
    job.sign_out(watchdog)
    dist.destroy_process_group()
    if stopped is not None:
        raise stopped
    return summary


def check_placement(cfg, placement: Placement, info: env.RankInfo) -> None:
    """Refuse an SP group on several nodes on every rank, before any model is built."""
    try:
        placement.check(cfg.layout.allow_cross_node_sp, model_geometry(cfg.model).num_attention_heads)
    except UserError:
        if info.rank == 0 and info.store_host == "rank 0":
            # The store lives in this process: let the others read the node list before it goes.
            time.sleep(rendezvous.VERDICT_GRACE_S)
        raise


def with_world(cfg, info: env.RankInfo):
    """A copy of ``cfg`` whose ``launcher.world`` is the launcher's world size.

    ``launcher.world`` may be left at 1 under a launcher (the launcher knows); any other value
    must agree with it.
    """
    if cfg.launcher.world not in (1, info.world):
        raise UserError(
            f"launcher.world={cfg.launcher.world} but {info.launcher} started {info.world} ranks; "
            f"set launcher.world={info.world} or leave it unset."
        )
    cfg = copy.deepcopy(cfg)
    cfg.launcher.world = info.world
    return cfg
