"""Where ditrun keeps what it computes once for many runs (references, encoded prompts, the dispatch table)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ditrun``, or ``~/.cache/ditrun`` when that is unset."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ditrun"
