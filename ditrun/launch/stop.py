"""Stopping a run cleanly: on a signal, or when the process that started this rank is gone.

SIGTERM (``scancel``, preemption, Slurm's time limit), SIGINT (Ctrl-C) and SIGUSR1 (what
``sbatch --signal`` sends before the time limit) do not kill a rank. One flag, the first stop
requested, is read in two ways:

- at stop points: phase boundaries, every denoising step of the reference pass and of the edit
  loop, and every wait on another rank (``launch/job.py``). In the edit loop the ranks of one
  replica agree on the answer (``Job.should_stop``) and all abandon the edit in progress at the
  same step boundary (an unfinished edit has nothing worth keeping; every finished one is already
  in its results file);
- inside work a rank does alone, with no collective until its next stop point (encoding the
  prompts, the reference pass, building the model, compiling a region): there the handler raises
  ``RunStopped`` at once (``raising``), so a phase of minutes ends within a bytecode of the signal.

Either way the run then ends as a good run does, writes what it has, and the command exits with
128 + the signal's number, which tells Slurm, shells and schedulers that it was stopped.

A rank whose parent exits (the ``ditrun`` supervisor SIGKILLed, a launcher that died) treats it
as SIGTERM, and if it has not ended ``launcher.stop_timeout_s`` later (a rank stuck in a
collective, say) it ends itself: no rank outlives its parent.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from ditrun.stop_signals import STOP_SIGNALS

# How often a rank looks for its parent.
PARENT_POLL_S = 0.5


class RunStopped(BaseException):
    """The run was stopped by a signal; finished edits are kept and a rerun resumes after them.

    A ``BaseException``, as ``KeyboardInterrupt`` is: raised inside a library's code (a compiler's),
    it must not be taken for one of the library's own errors by an ``except Exception``.
    """

    def __init__(self, signum: int, detail: str = ""):
        self.signum, self.detail = signum, detail
        super().__init__(f"stopped by {signal_name(signum)}{detail}")

    def __reduce__(self):  # a spawned rank sends its stop to the supervisor
        return type(self), (self.signum, self.detail)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


FAULT = 1 << 16
"""Not a signal: the stop of a node's fault (a full disk, a folder that can no longer be written) in a run's own files.
It travels between ranks as a signal's stop does, and is larger than every signal's number, so the ranks' agreement
on a stop (the largest) prefers it: the run's files are what is wrong."""


class NodeFault(RunStopped):
    """A node's fault mid-run (``run/folders.py``): the run ends as a stop does (the finished edits' summary and
    the resume line, where the disk allows) and exits 1. ``why`` names the error and the file on the rank that
    found it (``found_here``); another rank has it from that one, or, where the news had not reached it yet, only
    that a rank could not write."""

    def __init__(self, why: str, found_here: bool = True):
        self.signum, self.detail, self.why, self.found_here = FAULT, "", why, found_here
        BaseException.__init__(self, f"stopped: {why}")

    def __reduce__(self):
        return NodeFault, (self.why, self.found_here)

    @property
    def exit_code(self) -> int:
        return 1

    @property
    def reason(self) -> str:
        """What the other ranks are told (after this rank's number)."""
        return f"could not write ({self.why})"


UNKNOWN_FAULT = "another rank could not write the run's files"


def stop_of(signum: int, reason: str = "") -> RunStopped:
    """The stop a rank raises for ``signum``, which another rank may have decided (``reason``: what it said)."""
    if signum == FAULT:
        return NodeFault(reason or UNKNOWN_FAULT, found_here=False)
    return RunStopped(signum, f" ({reason})" if reason else "")


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """The first stop signal this process received (or the parent's death), or None; and the failure another
    thread of this rank found (``fail``), which ends the rank's work the same ways."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.reason = ""
        self._previous: dict[int, object] = {}
        self._relay: Optional[Callable[[int], None]] = None
        self._watching = False
        self._raising = 0  # depth of ``raising`` blocks the main thread is in
        self._raised = False
        self._self_sent: Optional[int] = None  # the signal ``interrupt`` sent and the handler has not yet seen
        self.failure: Optional[BaseException] = None
        self._fault: Optional[NodeFault] = None  # this rank's own (``fault``)

    def request(self, signum: int, reason: str = "") -> None:
        if self.signum is None:
            default = UNKNOWN_FAULT if signum == FAULT else f"received {signal_name(signum)}"
            self.signum, self.reason = signum, reason or default

    def stopped(self) -> RunStopped:
        if self._fault is not None:
            return self._fault
        return stop_of(self.signum, self.reason)

    def fault(self, fault: NodeFault) -> None:
        """This rank's own node fault: a stop like a signal's for every rank (it travels as ``FAULT``), which
        ``stopped`` then raises as it was found."""
        if self.signum is None or self.signum != FAULT:
            self.signum, self.reason, self._fault = FAULT, fault.reason, fault

    def check(self) -> None:
        """A stop point: raise ``RunStopped`` if a stop was requested (or the failure another thread found)."""
        if self.failure is not None:
            raise self.failure
        if self.signum is not None:
            raise self.stopped()

    def fail(self, err: BaseException) -> None:
        """From another thread: end the main thread's work with ``err`` (a lost store host, found by the
        heartbeat) at its next stop point, or at once inside a ``raising`` block."""
        if self.failure is None:
            self.failure = err
            self.interrupt()

    @contextmanager
    def raising(self) -> Iterator[None]:
        """Work of this rank alone: a stop requested before or during it raises ``RunStopped`` in it.

        Never around a collective or a wait on another rank: a rank that left one early would leave
        its peers waiting in it.
        """
        self.check()
        self._raising += 1
        try:
            yield
        finally:
            self._raising -= 1

    def interrupt(self) -> None:
        """From another thread, once a stop was requested (or a failure found): end the main thread's
        ``raising`` block now (a signal to the main thread runs the handler, which raises, and wakes a
        sleep or a system call)."""
        signum = self.signum or (signal.SIGUSR1 if self.failure is not None else None)
        if signum == FAULT:  # not a signal: any stop signal ends the block, and ``stopped`` says what it was
            signum = signal.SIGUSR1
        if self._raising and self._previous and signum is not None and not self._raised:
            self._self_sent = signum
            signal.pthread_kill(threading.main_thread().ident, signum)

    def install(self, relay: Optional[Callable[[int], None]] = None) -> "StopRequest":
        """Catch the stop signals (main thread only); ``restore`` puts the previous handlers back.

        ``relay`` is also called with each signal (a supervisor passes it on to its ranks).
        """
        self._relay = relay
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        self_sent, self._self_sent = self._self_sent == signum, None
        if self.failure is not None and self._raising and not self._raised:
            self._raised = True
            raise self.failure  # sent by ``interrupt``: not a stop request
        if self_sent and self.failure is not None:
            # ``interrupt``'s signal, come after the block it was to end: the failure stands, nobody asked to stop.
            return
        self.request(signum)
        if self._relay is not None:
            self._relay(signum)
        if self._raising and not self._raised:
            self._raised = True  # once: the unwinding and the end of the run are not interrupted again
            raise self.stopped()

    def watch_parent(self, grace_s: float, label: str, parent: Optional[int] = None) -> None:
        """Stop when the parent process (``parent``, default: the current one) exits; end this
        process ``grace_s`` later if it is still running. Watching twice changes nothing."""
        if self._watching:
            return
        self._watching = True
        parent = parent or os.getppid()
        thread = threading.Thread(
            target=self._watch_parent, args=(parent, grace_s, label), name="ditrun-parent-watch", daemon=True
        )
        thread.start()

    def _watch_parent(self, parent: int, grace_s: float, label: str) -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        self.request(signal.SIGTERM, f"parent process {parent} exited")
        self.interrupt()
        time.sleep(grace_s)
        print(
            f"ditrun: {label}: parent process {parent} exited and this rank did not stop within "
            f"{grace_s:g} s (launcher.stop_timeout_s); ending it",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGTERM)


_PROCESS_STOP = StopRequest()


def process_stop() -> StopRequest:
    """This process's stop request: signal handlers and the parent are the process's, not a run's."""
    return _PROCESS_STOP
