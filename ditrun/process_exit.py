"""How a ditrun process ends once its work is done: the command's and each spawned rank's.

An interpreter's own end tears every module down and collects every object still alive: with torch, Hydra and a
model loaded, about a second of CPU in each process after its last file is written, which a run's command waits for
(its ranks', then its own). ``exit_now`` ends the process as that would, less the teardown: the threads that are not
daemons are joined, the exit handlers run (logging's, W&B's, multiprocessing's, the compiler's temporary folders),
MPI is finalized where mpi4py started it, standard output and error are flushed, then the process exits with its
status. ditrun closes what it writes itself."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def status_of(code) -> int:
    """The exit status ``sys.exit(code)`` gives: None is 0, a number itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_now(code: int) -> NoReturn:
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    _finalize_mpi()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    os._exit(code)


def _finalize_mpi() -> None:
    """MPI's own end, which mpi4py leaves to the interpreter's (an MPI rank that exits without it is an abnormal
    termination to Open MPI's launcher)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def run_then_exit(body) -> NoReturn:
    """``body()``, then ``exit_now`` with the status it ended with (an exception other than ``SystemExit`` is
    left to the interpreter: its traceback and exit 1)."""
    try:
        body()
    except SystemExit as end:
        exit_now(status_of(end.code))
    exit_now(0)
