"""Progress on rank 0: bars on a terminal, plain lines in a log.

A bar redraws itself with carriage returns, which a log file (a pipe, ``nohup``, a Slurm output) would keep as
noise, so bars draw only on a terminal. When stdout is not one, ``ACTIVITY`` prints what is running instead, at
most every ``LOG_EVERY_S`` seconds and only while a phase lasts longer: ``ditrun: edit 3/20, astronaut step 12/28,
41 s`` (the seconds are the innermost phase's so far). Phases nest: the model's load, compiling inside an edit, the
references' edits inside the references.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TextIO

from tqdm import tqdm

LOG_EVERY_S = 30.0
"""Seconds between two progress lines in a log."""


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


class Activity:
    """What this process is doing, as a stack of phases; while any runs, a thread prints it every ``every_s``."""

    def __init__(
        self,
        every_s: float = LOG_EVERY_S,
        stream: Optional[TextIO] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.every_s = every_s
        self._stream = stream  # None: sys.stdout when printing (tests and Hydra may replace it)
        self._clock = clock
        self._phases: list[list] = []  # [label, start]
        self._lock = threading.Lock()
        self._stop: Optional[threading.Event] = None

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def logs(self) -> bool:
        """Whether lines are printed: only where bars would not be seen."""
        return not is_terminal(self.stream)

    @contextmanager
    def phase(self, label: str, enabled: bool = True) -> Iterator[None]:
        if not enabled or not self.logs():
            yield
            return
        self.push(label)
        try:
            yield
        finally:
            self.pop()

    def push(self, label: str) -> None:
        with self._lock:
            self._phases.append([label, self._clock()])
            if len(self._phases) == 1:
                self._stop = threading.Event()
                threading.Thread(
                    target=self._print_every, args=(self._stop,), name="ditrun-progress", daemon=True
                ).start()

    def relabel(self, label: str) -> None:
        """The innermost phase's label, its start kept (an edit's step count)."""
        with self._lock:
            if self._phases:
                self._phases[-1][0] = label

    def pop(self) -> None:
        with self._lock:
            self._phases.pop()
            if not self._phases and self._stop is not None:
                self._stop.set()

    def line(self) -> Optional[str]:
        with self._lock:
            if not self._phases:
                return None
            labels = ", ".join(label for label, _ in self._phases)
            return f"ditrun: {labels}, {self._clock() - self._phases[-1][1]:.0f} s"

    def _print_every(self, stop: threading.Event) -> None:
        while not stop.wait(self.every_s):
            line = self.line()
            if line is not None:
                print(line, file=self.stream, flush=True)


ACTIVITY = Activity()
"""This process's: its output is one stream, whatever phase prints to it."""

PHASES = {
    "prompts": "encoding the prompts",
    "references": "making the references",
    "build": "loading the model",
    "compile": "compiling",
}
"""What a log calls the worker's phases (``run/worker.py``'s ``Run.solo``)."""


class _LoggedSteps:
    """An edit's steps as a phase of ``Activity``, with the interface of the terminal's bar."""

    def __init__(self, activity: Activity, label: str, steps: int):
        self.activity, self.label, self.steps, self.n = activity, label, steps, 0
        self.open = True
        activity.push(self._text())

    def _text(self) -> str:
        return f"{self.label} step {self.n}/{self.steps}"

    def update(self, n: int = 1) -> None:
        self.n += n
        self.activity.relabel(self._text())

    def close(self) -> None:
        if self.open:
            self.open = False
            self.activity.pop()


class Progress:
    """``with Progress(on, n_edits) as p: bar = p.edit(id, steps); ...; bar.close(); p.advance()``."""

    def __init__(
        self,
        enabled: bool,
        edits: int,
        desc: str = "edits",
        stream: Optional[TextIO] = None,
        activity: Optional[Activity] = None,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(enabled and is_terminal(self.stream))
        self.activity = activity or ACTIVITY
        self.logged = bool(enabled) and not self.enabled and self.activity.logs()  # lines where no bar draws
        self.edits, self.done = edits, 0
        self.workload = tqdm(
            total=edits,
            desc=desc,
            unit="edit",
            file=self.stream,
            position=0,
            disable=not self.enabled,
            dynamic_ncols=True,
        )

    def edit(self, name: str, steps: int):
        """The bar of one edit's denoising steps (it disappears when closed); in a log, the edit as a phase."""
        if self.logged:
            return _LoggedSteps(self.activity, f"edit {self.done + 1}/{self.edits}, {name}", steps)
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
        self.done += 1
        self.workload.update(1)

    def close(self) -> None:
        self.workload.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
