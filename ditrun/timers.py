"""Clocks that the transports, the step cache and the worker share: CUDA/HIP events on GPUs, a monotonic clock on
CPUs.

Events are recorded on the compute stream without synchronising; the times are read once,
when the edit ends, so timing never stalls the pipeline.

Start-up of a rank = process start to its first denoising step, split into the phases a scaling
model needs (``Startup``): imports and config, the rendezvous (what grows with the node count),
and loading (prompts, references, model build); and into the parts a user asks about (where the first
minute goes): the reference pass, the model's build and weight load, compiling, CUDA-graph capture and
the compile cache's reads and writes. What the numbers are summed and summarised into is
``metrics/timing.py``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch


def _mark(cuda: bool):
    """A point in time: an event recorded on the current stream (GPU) or the monotonic clock (CPU)."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


class StepTimer:
    """Seconds per denoising step of one edit."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def start(self) -> None:
        self._marks = [_mark(self.cuda)]

    def step(self, _index: int = 0) -> None:
        self._marks.append(_mark(self.cuda))

    def step_seconds(self) -> list[float]:
        """Per-step seconds; synchronises once on GPUs."""
        if self.cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]


class Interval:
    """Seconds of one region outside the DiT (encode, decode): ``with Interval(dev) as t: ...; t.seconds``."""

    def __init__(self, device: torch.device):
        self._timer = StepTimer(device)

    def __enter__(self) -> "Interval":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._timer.step()
        return False

    @property
    def seconds(self) -> float:
        return self._timer.step_seconds()[0]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory allocated by PyTorch on the device since start (0 on CPUs, where it is not tracked)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def reset_peak_memory(device: torch.device) -> None:
    """Forget the peak so far (the reference pass runs another model before the measured one)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class ExposedTransfer:
    """Time the compute stream spends waiting on the transport, per edit.

    A transport wraps every wait of the compute stream in ``timed(kind, group)``. On GPUs the
    interval is bounded by two events on the compute stream, so it measures the stall the wait
    causes there, not the length of the transfer (which may be hidden behind attention); on
    CPUs it is the wall time of the wait. ``take()`` returns the totals and starts again.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, int, object, object]] = []

    def timed(self, kind: str = "attention", group: int = 0):
        return _TimedWait(self, kind, group)

    def take(self) -> dict:
        """``{"total_s": float, "by_kind": {kind: s}, "by_group": {group: s}}``; synchronises once on GPUs."""
        by_kind: dict[str, float] = {}
        by_group: dict[int, float] = {}
        if self.cuda and self._pending:
            self._pending[-1][3].synchronize()
        for kind, group, start, end in self._pending:
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            by_kind[kind] = by_kind.get(kind, 0.0) + seconds
            by_group[group] = by_group.get(group, 0.0) + seconds
        self._pending = []
        return {"total_s": sum(by_kind.values()), "by_kind": by_kind, "by_group": by_group}


class _TimedWait:
    def __init__(self, owner: ExposedTransfer, kind: str, group: int):
        self.owner, self.kind, self.group = owner, kind, group

    def __enter__(self):
        self.start = _mark(self.owner.cuda)
        return self

    def __exit__(self, *exc):
        self.owner._pending.append((self.kind, self.group, self.start, _mark(self.owner.cuda)))
        return False


def process_age_s() -> Optional[float]:
    """Seconds since this process started, by the kernel's clock (Linux), so that the interpreter's
    own start and the imports count too; None where /proc is missing."""
    try:
        with open("/proc/self/stat") as stat:
            # Field 22 (starttime, clock ticks after boot); the command name before it may hold spaces.
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as uptime:
            return float(uptime.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


class Startup:
    """This process's start-up, in seconds: the process's age when ditrun's launch began
    (``imports_s``), the rendezvous and process-group set-up (``rendezvous_s``), loading
    (``load_s``) and the age at the first denoising step (``startup_s``).

    Its parts (``PARTS``; None where a run has none): within loading, the reference pass
    (``references_s``, the BF16 reference edits made or read) and the model's build and weight load
    (``build_s``); within the first steps, compiling (``compile_s``: the compiler backend's time, summed
    over the run's compilations, so mostly the first edit's), Dynamo's tracing and guard building around it
    (``trace_s``: ``dynamo_trace_s``) and capturing CUDA graphs (``graphs_s``); and
    the compile cache's reads and writes (``compile_cache_s``). ``notes`` carry what the parts did
    (``compile_cache``: hit, miss, ...).

    A process may run several jobs (a local Hydra sweep runs each in the sweep's process): ``start_job`` begins
    each, and a job after the first counts its ages from its own start, has no ``imports_s`` (the process
    imported once, for the first job) and says so (``process``: ``reused``)."""

    PHASES = ("imports_s", "rendezvous_s", "load_s", "startup_s")
    PARTS = ("references_s", "build_s", "compile_s", "trace_s", "graphs_s", "compile_cache_s")

    def __init__(self):
        self._clear()
        self._job_age: Optional[float] = None  # the process's age when its current job began

    def _clear(self) -> None:
        self.fields: dict[str, Optional[float]] = dict.fromkeys(self.PHASES + self.PARTS)
        self.notes: dict[str, str] = {}
        self._begun: dict[str, float] = {}
        self._traced = dynamo_trace_s()  # the process's earlier jobs' tracing is not this job's

    def start_job(self) -> None:
        """A job begins in this process: the first counts from the process's start, a later one from here."""
        if self._job_age is None:
            self._job_age = 0.0
            self.at_age("imports_s")
            return
        self._clear()
        self._job_age = process_age_s() or 0.0
        self.notes["process"] = "reused"

    def begin(self, phase: str) -> None:
        self._begun[phase] = time.perf_counter()

    def end(self, phase: str) -> None:
        self.fields[phase] = time.perf_counter() - self._begun.pop(phase)

    @contextmanager
    def adding(self, part: str) -> Iterator[None]:
        """Add the seconds of the block to ``part`` (a part that runs many times: each compilation)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.fields[part] = (self.fields[part] or 0.0) + time.perf_counter() - start

    def at_age(self, phase: str) -> None:
        """Record the job's age (the process's, in its first job) as ``phase`` the first time only (the first
        step, not every step)."""
        if self.fields[phase] is None:
            age = process_age_s()
            self.fields[phase] = None if age is None else age - (self._job_age or 0.0)

    def report(self, rank: int = 0) -> dict:
        traced = dynamo_trace_s() - self._traced
        self.fields["trace_s"] = traced if self.fields["compile_s"] is not None or traced > 0 else None
        return {"rank": rank, "host": socket.gethostname(), **self.fields, **self.notes}


def dynamo_trace_s() -> float:
    """Seconds this process spent in Dynamo's compilations less their compiler backend's: tracing the bytecode,
    building the graph and its guards (PyTorch's own compile-time counters, ``torch._dynamo.utils``; 0 where
    nothing was compiled, or where this PyTorch keeps no such counters)."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled
    metrics = getattr(utils, "compilation_time_metrics", None)
    if not isinstance(metrics, dict):
        return 0.0
    whole = sum(metrics.get("_compile.compile_inner", ()))
    backend = sum(metrics.get("OutputGraph.call_user_compiler", ()))
    return max(0.0, whole - backend)


# One process, one start: the launcher, the worker and the step loop each record their phase.
STARTUP = Startup()
