"""Where ditrun keeps what it computes once for many runs: ``$XDG_CACHE_HOME/ditrun`` (``~/.cache/ditrun``).

Prompts, references, the dispatch table and compiled code each take a folder or file under it, and each has a
config key that moves it (on a cluster, to shared storage).
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """ditrun's folder under the user's cache (XDG base directories): ``$XDG_CACHE_HOME/ditrun``, else
    ``~/.cache/ditrun``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ditrun"
