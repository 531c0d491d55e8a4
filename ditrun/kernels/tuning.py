"""The dispatch table: which backend runs a quantized linear of a given shape on this device.

Entries are keyed by (op, format, M bucket, K, N, device name, torch version) and saved as JSON
by ``ditrun tune`` (``ditrun/tune.py``), which times every candidate on the run's real shapes
and data and keeps the fastest one that matches the emulation reference. A later process loads
the file; a shape with no entry uses the default preference (``linear.DEFAULT_PREFERENCE``), and the
model's build says so in one line for all of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from ditrun.devices import device_name
from ditrun.kernels.linear import LINEAR_BACKENDS, LinearBackend, LinearFormat, fast_backends
from ditrun.user_cache import user_cache_dir

BACKEND_MODES = {
    "auto": "the tuned choice where the table has one, else the preferred fast backend, else emulation",
    "emulation": "the exact emulation everywhere (dequantize + matmul)",
    "fast": "fast backends only: a format this device cannot run fast is an error before any GPU work",
}


def m_bucket(m: int) -> int:
    """Rows of a call, rounded up to a power of two (at least 16): one tuning entry per bucket."""
    return max(16, 1 << (max(m, 1) - 1).bit_length())


def default_table_path() -> Path:
    return user_cache_dir() / "dispatch.json"


def device_key(device: torch.device) -> str:
    return device_name(device) if device.type == "cuda" else "cpu"


def entry_key(fmt: str, m: int, k: int, n: int, device: str, torch_version: str = torch.__version__) -> str:
    return f"linear|{fmt}|m{m_bucket(m)}|k{k}|n{n}|{device}|torch {torch_version}"


class DispatchTable:
    """Saved choices, plus the rule for shapes without one."""

    def __init__(
        self,
        device: torch.device,
        mode: str = "auto",
        entries: Optional[dict[str, str]] = None,
        path: Optional[Path] = None,
        announce: bool = True,
        prepare_all: bool = False,
    ):
        self.device, self.mode, self.path, self.announce = device, mode, path, announce
        self.prepare_all = prepare_all
        """Prepare weights for every candidate (``ditrun tune`` times them all on the same weights)."""
        self.entries: dict[str, str] = dict(entries or {})
        self.untuned: list[str] = []
        """Shapes ``choose`` found no entry for, as ``fmt K= N= -> backend`` (said once by ``say_untuned``)."""
        self._said: set[str] = set()

    @classmethod
    def load(cls, path: Optional[Path], device: torch.device, mode: str = "auto", announce: bool = True):
        entries = json.loads(path.read_text())["entries"] if path is not None and path.is_file() else {}
        return cls(device, mode, entries, path, announce)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"entries": dict(sorted(self.entries.items()))}, indent=2))
        tmp.replace(path)

    def _say_once(self, key: str, message: str) -> None:
        if self.announce and key not in self._said:
            self._said.add(key)
            print(f"ditrun: {message}", flush=True)

    def candidates(self, fmt: LinearFormat) -> list[str]:
        """Backends this mode may use for ``fmt`` here, preferred first (never empty but in ``fast`` mode).

        A backend's name as the mode puts that backend first wherever it runs ``fmt`` here."""
        if self.mode == "emulation":
            return ["emulation"]
        fast = fast_backends(fmt, self.device)
        if self.mode in fast:
            fast = [self.mode, *(name for name in fast if name != self.mode)]
        return fast if self.mode == "fast" else [*fast, "emulation"]

    def tuned(self, fmt: LinearFormat, k: int, n: int) -> dict[int, str]:
        """M bucket -> backend, for the entries of this shape and device."""
        prefix, suffix = f"linear|{fmt.name}|m", f"|k{k}|n{n}|{device_key(self.device)}|torch {torch.__version__}"
        return {
            int(key[len(prefix) : -len(suffix)]): name
            for key, name in self.entries.items()
            if key.startswith(prefix) and key.endswith(suffix)
        }

    def choose(self, fmt: LinearFormat, k: int, n: int) -> tuple[dict[str, LinearBackend], Callable[[int], str]]:
        """The backends to prepare this linear's weights for, and the rule that picks one per call."""
        allowed = self.candidates(fmt)
        # Only ``auto`` follows the table: a named backend or ``fast`` is the user's own choice.
        tuned = {m: b for m, b in self.tuned(fmt, k, n).items() if b in allowed} if self.mode == "auto" else {}
        default = allowed[0]
        if default == "emulation" and self.mode == "auto" and self.device.type == "cuda":
            self._say_once(fmt.name, f"{fmt.name} has no fast backend on this device; it runs as the exact emulation.")
        if self.mode in LINEAR_BACKENDS and default != self.mode and fmt.quantized:
            why = LINEAR_BACKENDS.get(self.mode)().unavailable(fmt, self.device)
            self._say_once(
                f"{self.mode}|{fmt.name}", f"precision.backend={self.mode} {why} here; {fmt.name} runs {default}."
            )
        names = allowed if self.prepare_all else sorted(set(tuned.values())) or [default]
        backends = {name: LINEAR_BACKENDS.get(name)() for name in names}
        first = names[0]
        if self.mode == "auto" and len(allowed) > 1 and len(tuned) < 1:
            self.untuned.append(f"{fmt.name} K={k} N={n} -> {first}")

        def pick(m: int) -> str:
            # Pure (a dict lookup on a static row count): traced into compiled regions.
            return tuned.get(m_bucket(m), first)

        return backends, pick

    def say_untuned(self) -> None:
        """One line for every linear shape the table has no entry for (gathered by ``choose``), once: calls may run
        inside a compiled graph, where nothing can be printed, so it is said when the model is built."""
        if self.untuned:
            shapes = sorted(set(self.untuned))
            listed = ", ".join(shapes[:3]) + (f" and {len(shapes) - 3} more" if len(shapes) > 3 else "")
            self._say_once(
                "untuned",
                f"{len(shapes)} linear shape(s) have no tuned backend here ({listed}); `ditrun tune` saves a choice.",
            )
