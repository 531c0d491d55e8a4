"""The signals that ask a run to stop at a step boundary (``launch/stop.py``). A module of its own, with no import
of ditrun, so that a rank installs its early handlers (``rank_entry.py``) before any heavy import."""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
