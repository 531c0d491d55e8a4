"""Stopping a run cleanly: on a signal, or when the process that started this rank is gone.

SIGTERM (``scancel``, preemption, Slurm's time limit), SIGINT (Ctrl-C) and SIGUSR1 (what
``sbatch --signal`` sends before the time limit) do not kill a rank: the handler only notes the
signal. The edit loop asks at every denoising step and before every edit (``Job.should_stop``),
the ranks of one replica agree on the answer, and they all abandon the edit in progress at the
same step boundary (an unfinished edit has nothing worth keeping; every finished one is already
in its results file). The run then ends as a good run does, writes what it has, and the command
exits with 128 + the signal's number, which tells Slurm, shells and schedulers that it was stopped.

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
from typing import Callable, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# How often a rank looks for its parent.
PARENT_POLL_S = 0.5


class RunStopped(Exception):
    """The run was stopped by a signal; finished edits are kept and a rerun resumes after them."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)}{detail}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopRequest:
    """The first stop signal this process received (or the parent's death), or None."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.reason = ""
        self._previous: dict[int, object] = {}
        self._relay: Optional[Callable[[int], None]] = None
        self._watching = False

    def request(self, signum: int, reason: str = "") -> None:
        if self.signum is None:
            self.signum, self.reason = signum, reason or f"received {signal_name(signum)}"

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
        self.request(signum)
        if self._relay is not None:
            self._relay(signum)

    def watch_parent(self, grace_s: float, label: str, parent: Optional[int] = None) -> None:
        """Stop when the parent process (``parent``, default: the current one) exits; end this
        process ``grace_s`` later if it is still running. Watching twice changes nothing."""
        if self._watching:
            return
        self._watching = True
        parent = parent or os.getppid()
        thread = threading.Thread(target=self._watch_parent, args=(parent, grace_s, label),
                                  name="ditrun-parent-watch", daemon=True)
        thread.start()

    def _watch_parent(self, parent: int, grace_s: float, label: str) -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        self.request(signal.SIGTERM, f"parent process {parent} exited")
        time.sleep(grace_s)
        print(f"ditrun: {label}: parent process {parent} exited and this rank did not stop within "
              f"{grace_s:g} s (launcher.stop_timeout_s); ending it", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)


_PROCESS_STOP = StopRequest()


def process_stop() -> StopRequest:
    """This process's stop request: signal handlers and the parent are the process's, not a run's."""
    return _PROCESS_STOP
