"""Run a function on N gloo ranks, forked from the test process, with every wait bounded.

    results = run_ranks(fn, world=4, args=(cfg, out_dir), timeout=60)

Each rank is a forked child with ``torch.distributed`` initialised (gloo, a ``file://``
rendezvous in a fresh temporary folder, ``collective_timeout`` on every collective) and one
intra-op thread, since several ranks share few cores. ``backend="nccl"`` starts the ranks with
``spawn`` instead (CUDA cannot be used in a forked child) with rank r on GPU r; ``fn`` must then
be importable (a module-level function); ``backend="shared_gpu"`` spawns gloo ranks that all use GPU 0 (NCCL
refuses two ranks on one GPU: the copy-engine transport moves their tensors through CUDA IPC). ``fn(rank, world, *args)`` runs there;
its return value comes back pickled, in rank order. If a rank raises, the others are killed
and its traceback is raised here; if they do not all finish within ``timeout`` seconds, they
are all killed and the ranks that had not reported are named. Forking keeps start-up at a
fraction of a second (no re-import of torch), so tests can afford many small jobs.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _rank_main(fn, rank: int, world: int, args, store: str, collective_timeout: float, results, backend: str) -> None:
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if backend == "shared_gpu":
            torch.cuda.set_device(0)
        dist.init_process_group(
            "gloo" if backend == "shared_gpu" else backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        try:
            value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence = (),
    timeout: float = 60.0,
    collective_timeout: float = 30.0,
    backend: str = "gloo",
    lost: Sequence[int] = (),
) -> list:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each run on its own rank.

    Ranks in ``lost`` are expected to die without a result (a test of how the others cope): their
    entries are None and only the other ranks are waited for.
    """
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    results = ctx.Queue()
    folder = tempfile.mkdtemp(prefix="ranks-")
    store = os.path.join(folder, "store")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world, tuple(args), store, collective_timeout, results, backend),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world, timeout, set(lost))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        shutil.rmtree(folder, ignore_errors=True)


def _collect(procs, results, world: int, timeout: float, lost: set) -> list:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    suspects: set[int] = set()
    while len(values) < world - len(lost):
        try:
            rank, ok, payload = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            # A rank that exited may still have its result in the pipe: convict it on the second miss.
            dead = {r for r, p in enumerate(procs) if r not in values and r not in lost and not p.is_alive()}
            if dead & suspects:
                gone = sorted(dead & suspects)
                raise RankFailed(
                    f"rank(s) {gone} exited without a result (exit codes {[procs[r].exitcode for r in gone]})."
                )
            suspects = dead
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(values) - lost)
                raise TimeoutError(f"rank(s) {missing} did not finish within {timeout:.0f} s.")
            continue
        if not ok:
            raise RankFailed(_failures({rank: payload}, results))
        values[rank] = pickle.loads(payload)
    return [values.get(r) for r in range(world)]


def _failures(failed: dict[int, str], results, grace: float = 2.0) -> str:
    """Every failure that arrives within ``grace`` seconds of the first: the root cause is often
    on another rank than the first to report (its peers fail when it goes away)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue.Empty:
            break
        if not ok:
            failed[rank] = payload
    return "\n".join(f"rank {rank} failed:\n{text}" for rank, text in sorted(failed.items()))
