"""Timing of denoising steps: CUDA/HIP events on GPUs, a monotonic clock on CPUs.

Events are recorded on the compute stream without synchronising; the times are read once,
when the edit ends, so timing never stalls the pipeline.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Seconds per denoising step of one edit."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [self._now()]

    def step(self, _index: int = 0) -> None:
        self._marks.append(self._now())

    def step_seconds(self) -> list[float]:
        """Per-step seconds; synchronises once on GPUs."""
        if self.cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory allocated by PyTorch on the device since start (0 on CPUs, where it is not tracked)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


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

    def _now(self):
        if self.owner.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __enter__(self):
        self.start = self._now()
        return self

    def __exit__(self, *exc):
        self.owner._pending.append((self.kind, self.group, self.start, self._now()))
        return False
