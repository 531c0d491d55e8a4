"""The first code a spawned rank runs (``launch/spawn.py`` starts it, ``launch/rank.py`` runs the rank): stop signals
are caught before anything heavy is imported.

A spawned interpreter spends its first seconds importing torch and the rest. A stop signal that
arrived then would raise ``KeyboardInterrupt`` (SIGINT) inside some import, or kill the rank
outright (SIGTERM), before ``launch/stop.py`` had installed its handlers: the rank would fail
with whatever the half-done import left behind (a lazy loader's ``RecursionError``, say) instead
of stopping. So this module (the standard library, ``stop_signals.py`` and ``process_exit.py`` only: what the spawn
unpickles first) notes stop signals from its first instruction and then tells the supervisor it is ready, and only
then does the supervisor relay its own stop signals to the rank (``spawn.Relay``); the notes go to the
rank's stop request once that exists, and the rank stops at its first step boundary like any
stopped rank. A signal sent straight to a rank in the first instants of its interpreter, before
this module runs, still ends it: the supervisor reports that rank as failed.
"""

from __future__ import annotations

import pickle
import signal

from ditrun.process_exit import run_then_exit
from ditrun.stop_signals import STOP_SIGNALS

_noted: list[int] = []


def _note(signum, _frame) -> None:
    _noted.append(signum)


def rank_main(payload: bytes, sender) -> None:
    """Catch stop signals, then import the rank's code and run it with ``payload``'s arguments (pickled
    by the supervisor, so that unpickling them, which imports omegaconf, is also covered)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _note)
    args = pickle.loads(payload)  # (cfg, out_dir, work, rank, world, port, job_secret, supervisor, hydra_files)
    sender.send(("ready", args[3]))  # the supervisor relays its stop signals from now on
    from ditrun.launch.rank import spawned_rank_main
    from ditrun.launch.stop import process_stop

    stop = process_stop().install()
    for signum in _noted:  # the notes of a signal that came before this line are not lost
        stop.request(signum)
    run_then_exit(lambda: spawned_rank_main(*args, sender=sender))
