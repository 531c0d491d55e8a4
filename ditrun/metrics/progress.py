"""Progress bars on rank 0: one for the workload (edits), one per edit (denoising steps).

They draw only on a terminal: in a log file, a pipe or a Slurm output they would be noise, so
there they stay silent.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

from tqdm import tqdm


class Progress:
    """``with Progress(on, n_edits) as p: bar = p.edit(id, steps); ...; bar.close(); p.advance()``."""

    def __init__(self, enabled: bool, edits: int, desc: str = "edits", stream: Optional[TextIO] = None):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(enabled and isatty is not None and isatty())
        self.workload = tqdm(
            total=edits,
            desc=desc,
            unit="edit",
            file=self.stream,
            position=0,
            disable=not self.enabled,
            dynamic_ncols=True,
        )

    def edit(self, name: str, steps: int) -> tqdm:
        """The bar of one edit's denoising steps; it disappears when closed."""
        return tqdm(
            total=steps,
            desc=name,
            unit="step",
            file=self.stream,
            position=1,
            leave=False,
            disable=not self.enabled,
            dynamic_ncols=True,
        )

    def advance(self) -> None:
        self.workload.update(1)

    def close(self) -> None:
        self.workload.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
