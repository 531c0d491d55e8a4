"""Failures: a rank that fails takes the whole job down within seconds, naming itself.

A failing rank posts one notice on the rendezvous store (the first notice wins). Every rank runs
a watchdog thread blocked on that key; when a notice from another rank appears it prints it and
ends its process at once, even while the main thread sits inside a collective that would
otherwise wait for the dead rank until ``launcher.collective_timeout_s``. The same key ends the
watchdogs quietly at the end of a good run. A rank that dies without a word (killed, segfault)
is caught by the launcher (``srun --kill-on-bad-exit``, ``mpiexec``, torchrun, ditrun's own
spawner) and, at the latest, by the collective timeout of the ranks waiting for it.

``inject``, ``hang`` and ``pause`` are the test hooks: ``testing.fault.crash_rank`` fails on
purpose inside the denoising loop at ``testing.fault.crash_at_step``, and ``testing.fault.freeze_rank``
stops itself there (SIGSTOP); ``testing.fault.hang_rank``
hangs once its edits are done; ``testing.fault.pause_in`` holds a rank inside a phase of its start
(says so, then sleeps as a long phase would compute), so that a test can stop it there.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ditrun.errors import UserError


class WorkerFailed(RuntimeError):
    """A rank of this job failed; the message names it. (User mistakes are ``UserError``s instead.)"""


STOP = "ditrun/stop"
DONE = "done"
# The exit code of a rank stopped because another one failed (not 1, which its own errors use).
PEER_FAILED_EXIT = 3
# After posting or reading a notice, rank 0 (the store's host) lingers this long before exiting
# so that every other watchdog can read the notice instead of finding the store gone.
HOST_GRACE_S = 1.0


class InjectedFault(RuntimeError):
    """A failure raised on purpose by ``testing.fault``."""


def inject(fault_cfg, step: int) -> None:
    """Called after every denoising step: the chosen rank fails, or freezes, at the chosen step."""
    if step != fault_cfg.crash_at_step:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == fault_cfg.freeze_rank:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, its sockets open, silent: as a process stuck in the kernel
    if rank == fault_cfg.crash_rank:
        raise InjectedFault(
            f"rank {rank} failed on purpose at denoising step {step} "
            f"(testing.fault.crash_rank={rank}, testing.fault.crash_at_step={step})"
        )


def hang(fault_cfg) -> None:
    """Called once a rank's edits are done: the chosen rank never gets further."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    while rank == fault_cfg.hang_rank:
        time.sleep(3600)


# The phases a rank works through alone, with no collective, before and inside its first edit
# (``worker.Run.solo``): a stop signal ends each at once.
PAUSE_PHASES = ("prompts", "references", "build", "compile")


def pause(fault_cfg, phase: str, rank: int) -> None:
    """Called as ``phase`` begins on ``rank``: the chosen rank says so, then works forever (a stop ends it)."""
    if fault_cfg.pause_in != phase or fault_cfg.pause_rank not in (None, rank):
        return
    print(
        f"ditrun: rank {rank} (pid {os.getpid()}) paused in {phase} (testing.fault.pause_in={phase})",
        file=sys.stderr,
        flush=True,
    )
    while True:
        time.sleep(3600)


def check_testing_config(testing_cfg, world: int, steps: int) -> None:
    """``testing.*`` mistakes, one sentence each (the tests' own settings)."""
    if testing_cfg.chaos_s < 0:
        raise UserError(f"testing.chaos_s={testing_cfg.chaos_s} must be 0 (off) or a positive number of seconds.")
    fault_cfg = testing_cfg.fault
    if fault_cfg.pause_in is not None and fault_cfg.pause_in not in PAUSE_PHASES:
        raise UserError(
            f"testing.fault.pause_in={fault_cfg.pause_in} is not a phase; allowed: {', '.join(PAUSE_PHASES)}."
        )
    for key in ("crash_rank", "freeze_rank", "hang_rank", "pause_rank"):
        rank = getattr(fault_cfg, key)
        if rank is not None and not 0 <= rank < world:
            raise UserError(f"testing.fault.{key}={rank} is not a rank of this job; allowed: 0 to {world - 1}.")
    if not 0 <= fault_cfg.crash_at_step < steps:
        raise UserError(
            f"testing.fault.crash_at_step={fault_cfg.crash_at_step} is not a denoising step; "
            f"allowed: 0 to {steps - 1} (workload.steps={steps})."
        )


def describe(err: BaseException) -> str:
    """``"TypeName: first line of the message"``, for one-line notices."""
    return f"{type(err).__name__}: {err}".strip().splitlines()[0]


def report(store, rank: int, err: BaseException) -> None:
    """Post this rank's failure for every watchdog; the first failure of the job is the one kept."""
    try:
        store.compare_set(STOP, "", f"failed\t{rank}\t{describe(err)}")
    except RuntimeError:
        return  # the store is gone (rank 0 left first): nobody is left to tell
    if rank == 0:
        time.sleep(HOST_GRACE_S)


def release(store) -> None:
    """End every watchdog quietly: the job finished (called by rank 0 once all ranks signed out)."""
    store.compare_set(STOP, "", DONE)


class Watchdog:
    """A thread that ends this process as soon as another rank reports a failure."""

    def __init__(self, meeting, rank: int):
        self.rank = rank
        self.where = f"{meeting.host}, which hosts the rendezvous at {meeting.address}"
        # Its own connection: a blocking wait must not hold the lock of the store that the
        # process group uses.
        self.store = meeting.store.clone()
        self.store.set_timeout(timedelta(days=365))
        self.thread = threading.Thread(target=self._watch, name=f"ditrun-watchdog-{rank}", daemon=True)

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the job's end to be announced (``release``); whether it was."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def _watch(self) -> None:
        try:
            self.store.wait([STOP])
            notice = self.store.get(STOP).decode()
        except RuntimeError:
            self._abort(
                f"lost contact with {self.where}: it exited or its host is unreachable; stopping rank {self.rank}"
            )
            return
        if notice == DONE:
            return
        _, failed_rank, message = notice.split("\t", 2)
        if int(failed_rank) != self.rank:
            self._abort(f"rank {failed_rank} failed ({message}); stopping rank {self.rank}")

    def _abort(self, message: str) -> None:
        print(f"ditrun: {message}", file=sys.stderr, flush=True)
        if self.rank == 0:
            time.sleep(HOST_GRACE_S)
        os._exit(PEER_FAILED_EXIT)
