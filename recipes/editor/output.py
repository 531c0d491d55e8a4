"""Writing the pipeline folder so that no failure harms one: the new folder is built under a temporary name beside
``--out`` and renamed into place only when complete; an existing non-empty ``--out`` is replaced only when asked.

Between the two renames of a replacement (the old folder aside, the new one in), SIGINT and SIGTERM wait, so a
Ctrl-C can land before the swap (the old folder stays) or after it (the new one is there), never in between.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Optional

HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def refusal(out: Path, replace: bool) -> Optional[str]:
    """The sentence that refuses ``--out`` before any work, or None when the folder may be written."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder."
    if not out.parent.is_dir():
        return f"--out {out}: its parent folder {out.parent} does not exist."
    if out.is_dir() and any(out.iterdir()) and not replace:
        return (
            f"--out {out} is not empty; pass --replace to replace it once the new folder is complete, "
            "or name another folder."
        )
    return None


class Staging:
    """The folder being built: ``.<name>.<random>.partial`` in ``out``'s parent (the same file system, so the final
    rename is atomic)."""

    def __init__(self, out: Path):
        self.out = out
        self.path = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        self.path.chmod(0o755)  # mkdtemp's 0700 would make the published folder private

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def publish(self) -> None:
        """Move the finished folder to ``out``; an existing ``out`` (checked by ``refusal``) is removed after."""
        aside = self.out.with_name(f".{self.out.name}.{os.getpid()}.replaced")
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
        try:
            if self.out.is_dir() and any(self.out.iterdir()):
                os.rename(self.out, aside)
            elif self.out.is_dir():
                self.out.rmdir()
            os.rename(self.path, self.out)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        shutil.rmtree(aside, ignore_errors=True)
