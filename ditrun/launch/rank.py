"""One rank's way through a job: the checks every rank makes, joining the others, running the worker, signing out.

``run_as_rank`` is the path of a rank that any launcher started (torchrun, ``srun``, ``mpiexec``, submitit, or
ditrun's own spawner, whose ranks enter through ``spawned_rank_main``); each checks the config first (the work's
``check``: ``ditrun.run.checks``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ditrun.errors import UserError
from ditrun.launch import env, faults, rendezvous, secret
from ditrun.launch.job import StoreJob
from ditrun.launch.stop import RunStopped, process_stop
from ditrun.launch.work import Work
from ditrun.model.build import model_geometry
from ditrun.parallel.placement import Placement
from ditrun.results.rundir import HydraFiles
from ditrun.timers import STARTUP


def run_as_rank(
    cfg, out_dir: Path, info: env.RankInfo, work: Work, hydra_files: Optional[HydraFiles] = None
) -> Optional[dict]:
    """Join the job as the rank the launcher started, check the config and run ``work`` (``work.py``), sign out.

    ``hydra_files`` reach the work, whose global rank 0 writes them once the directory is this run's."""
    run = functools.partial(work.run, hydra_files=hydra_files)
    cfg = with_world(cfg, info)
    plan = work.check(cfg, info.world)
    info = env.with_address(info, cfg.launcher.master_port)
    if not os.environ.get(secret.ENV) and info.launcher in env.MPI_LAUNCHERS:
        os.environ[secret.ENV] = secret.mpi_secret() or ""  # MPI is a channel the job owns already
    device = rendezvous.bind_device(cfg.device, info.local_rank, info.local_world)
    STARTUP.begin("rendezvous_s")
    meeting = rendezvous.meet(info, cfg.launcher.rendezvous_timeout_s, {"out_dir": str(out_dir)})
    backend = rendezvous.backend_for(cfg.device)
    placement = Placement(plan, meeting.nodes)
    if info.rank == 0:
        print(
            f"ditrun: {info.world} ranks on {len(placement.ranks_by_node())} node(s) ({info.launcher}) met at "
            f"{meeting.address}; {backend}, rank 0 on {device}\n{placement.describe()}",
            flush=True,
        )
    check_placement(cfg, placement, info)
    stop = process_stop().install()
    stop.watch_parent(cfg.launcher.stop_timeout_s, f"rank {info.rank}")
    stopped = summary = None
    job = StoreJob(
        meeting.store, info.rank, info.world, stop, cfg.launcher.collective_timeout_s, meeting.host
    ).start_heartbeat()
    try:
        rendezvous.init_process_group(info, backend, meeting, cfg.launcher.collective_timeout_s)
        STARTUP.end("rendezvous_s")
        watchdog = faults.Watchdog(meeting, info.rank).start()
        summary = run(cfg, Path(meeting.shared["out_dir"]), job, placement.nodes)
    except RunStopped as err:
        stopped = err  # not a failure: the run ends as a good one does, then says it was stopped
    except BaseException as err:
        # A lost node's ranks surface here as some collective's error: report them, not it.
        failure = job.explain(err)
        job.report(failure)
        record_for_launcher(failure)
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


def record_for_launcher(err: BaseException) -> None:
    """Under torchrun, write the failure into the error file it names, as its ``@record`` decorator would, so that
    torchrun's summary shows this rank's exception and traceback rather than only an exit code."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            raise err
        except BaseException as raised:  # record_exception reads the traceback of the exception being handled
            ErrorHandler().record_exception(raised)


# The variables that choose the interface gloo's and NCCL's bootstrap sockets listen on.
LOOPBACK_INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interface() -> str:
    """The name of this machine's loopback interface ("lo" on Linux)."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in names if name.startswith("lo")), "lo")


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


def spawned_rank_main(
    cfg,
    out_dir: Path,
    work: Work,
    rank: int,
    world: int,
    port: int,
    job_secret: str,
    supervisor: int,
    hydra_files,
    sender,
) -> None:
    """The body of one spawned rank: tell the supervisor how it ended, then exit.

    Its store, gloo's and NCCL's sockets stay on loopback (a user's own choice of interface is kept),
    and the job's secret comes from the supervisor (``launch.secret``)."""
    # Watched from the very start: a supervisor killed while this rank still imports or waits at
    # the rendezvous must not leave it behind.
    process_stop().watch_parent(cfg.launcher.stop_timeout_s, f"rank {rank}", parent=supervisor)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DITRUN_JOB_SECRET=job_secret,
    )
    for name in LOOPBACK_INTERFACE_VARS:
        os.environ.setdefault(name, loopback_interface())
    from tqdm import tqdm

    # tqdm's default lock is a named semaphore, which a rank ended by its watchdog (os._exit)
    # would leave behind; a rank's progress bars need no lock across processes.
    tqdm.set_lock(threading.RLock())

    try:
        info = dataclasses.replace(env.discover(), launcher=env.LOCAL_SPAWN)  # torchrun's variables, not torchrun
        summary = run_as_rank(cfg, out_dir, info, work, hydra_files=hydra_files)
    except (RunStopped, KeyboardInterrupt) as err:
        stopped = err if isinstance(err, RunStopped) else RunStopped(signal.SIGINT)
        sender.send(("stopped", rank, stopped))
        sys.exit(stopped.exit_code)
    except BaseException as err:  # every way a rank ends must reach the supervisor
        verdict = _is_verdict(err)
        if not verdict:
            traceback.print_exc()
        sender.send(("failed", rank, err if verdict else faults.describe(err)))
        sys.exit(2 if isinstance(err, UserError) else 1)
    sender.send(("done", rank, summary))


def _is_verdict(err: BaseException) -> bool:
    """Errors about the run rather than the rank (a config mistake, the quality gate): the
    supervisor raises them again as they are, so the command treats them as in one process."""
    from ditrun.metrics.quality import QualityGateError

    return isinstance(err, (UserError, QualityGateError))
