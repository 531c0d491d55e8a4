"""Where workers run: in this process, spawned locally, or as ranks of an external launcher."""

from __future__ import annotations

from pathlib import Path

from ditrun.launch import worker


def launch(cfg, out_dir: Path) -> dict:
    """Run the job described by ``cfg`` with results in ``out_dir``; returns rank 0's summary."""
    return worker.run(cfg, out_dir)
