"""What a launcher hands every rank it starts: a check of the config (before any rank starts, and again on each) and
the work itself. ``launch/`` knows nothing of the run beyond this (``ditrun.run.WORK`` is ditrun's)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional


class Work(NamedTuple):
    check: Callable
    """``check(cfg, world)`` -> the layout plan; raises ``UserError`` for a config that cannot run."""
    run: Callable[..., Optional[dict]]
    """``run(cfg, out_dir, job, nodes, hydra_files=...)`` -> the summary on global rank 0."""
