"""Timing of denoising steps: CUDA/HIP events on GPUs, a monotonic clock on CPUs.

Events are recorded on the compute stream without synchronising; the times are read once,
when the edit ends, so timing never stalls the pipeline.

DiT time of an edit = the sum of its denoising steps (both CFG branches, every layer, the
transport's waits); preparing the inputs (image load, VAE encode, prompt embeddings) and the
VAE decode are timed apart as ``encode_s`` and ``decode_s``.

Start-up of a rank = process start to its first denoising step, split into the phases a scaling
model needs (``Startup``): imports and config, the rendezvous (what grows with the node count),
and loading (prompts, references, model build); and into the parts a user asks about (where the first
minute goes): the reference pass, the model's build and weight load, compiling, CUDA-graph capture and
the compile cache's reads and writes. Each rank's split goes into the run's summary.
"""

from __future__ import annotations

import os
import socket
import statistics
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


def edit_timing(step_s: list[float], exposed: dict, breakdown: bool = False) -> dict:
    """The timing fields of one edit's record; ``exposed`` is ``ExposedTransfer.take()`` of that edit.

    A layout without a transport never waits, so its exposed transfer is 0, not missing.
    """
    dit_s = float(sum(step_s))
    exposed_s = float(exposed.get("total_s", 0.0))
    fields = {
        "dit_s": dit_s,
        "step_s": [float(s) for s in step_s],
        "exposed_transfer_s": exposed_s,
        "exposed_transfer_pct": 100.0 * exposed_s / dit_s if dit_s > 0 else 0.0,
    }
    if breakdown:
        fields["exposed_transfer_by_kind"] = {str(k): float(v) for k, v in exposed.get("by_kind", {}).items()}
        fields["exposed_transfer_by_group"] = {str(k): float(v) for k, v in exposed.get("by_group", {}).items()}
    return fields


def after_warmup(records: list[dict], warmup: int) -> list[dict]:
    """The records left after the first ``warmup`` edits of each replica in each process that wrote some (all of
    them if none would be left): a resumed run compiles and warms up again, so its first edits are warm-up too."""
    seen: dict[tuple, int] = {}
    kept = []
    for record in records:
        writer = (record.get("session"), record.get("replica", 0))
        seen[writer] = seen.get(writer, 0) + 1
        if seen[writer] > warmup:
            kept.append(record)
    return kept or list(records)


def median_of(records: list[dict], key: str) -> Optional[float]:
    """Median of ``key`` over the records that have it; None when none has."""
    values = [r[key] for r in records if r.get(key) is not None]
    return float(statistics.median(values)) if values else None


def timing_summary(records: list[dict], warmup: int, replicas: int) -> dict:
    """Medians over the edits after warm-up; images/s counts the replicas that ran an edit, in parallel
    (a replica with no edit of its own adds nothing)."""
    kept = after_warmup(records, warmup)
    busy = min(replicas, len({r.get("replica", 0) for r in records}))
    dit = median_of(kept, "dit_s")
    steps = [s for r in kept for s in r.get("step_s", [])]
    step = float(statistics.median(steps)) if steps else None
    return {
        "dit_s_median": dit,
        "step_s_median": step,
        "warmup_excess_s": warmup_excess([r for r in records if not any(r is k for k in kept)], step),
        "images_per_s": busy / dit if dit else float("nan"),
        "exposed_transfer_s_median": median_of(kept, "exposed_transfer_s"),
        "exposed_transfer_pct_median": median_of(kept, "exposed_transfer_pct"),
        "encode_s_median": median_of(kept, "encode_s"),
        "decode_s_median": median_of(kept, "decode_s"),
    }


def warmup_excess(warmup_records: list[dict], step_s: Optional[float]) -> Optional[float]:
    """Seconds the warm-up edits' steps took beyond the steady step median: what compiling, autotuning
    and first-use allocation cost (``model.compile``'s time, reported apart from DiT time). None
    without both warm-up and steady edits."""
    warm = [s for r in warmup_records for s in r.get("step_s", [])]
    if not warm or step_s is None:
        return None
    return max(0.0, sum(warm) - step_s * len(warm))


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
    over the run's compilations, so mostly the first edit's; Dynamo's tracing is not in it) and capturing
    CUDA graphs (``graphs_s``); and
    the compile cache's reads and writes (``compile_cache_s``). ``notes`` carry what the parts did
    (``compile_cache``: hit, miss, ...)."""

    PHASES = ("imports_s", "rendezvous_s", "load_s", "startup_s")
    PARTS = ("references_s", "build_s", "compile_s", "graphs_s", "compile_cache_s")

    def __init__(self):
        self.fields: dict[str, Optional[float]] = dict.fromkeys(self.PHASES + self.PARTS)
        self.notes: dict[str, str] = {}
        self._begun: dict[str, float] = {}

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
        """Record the process's age as ``phase`` the first time only (the first step, not every step)."""
        if self.fields[phase] is None:
            self.fields[phase] = process_age_s()

    def report(self, rank: int = 0) -> dict:
        return {"rank": rank, "host": socket.gethostname(), **self.fields, **self.notes}


# One process, one start: the launcher, the worker and the step loop each record their phase.
STARTUP = Startup()


def _median_and_max(by_rank: list[dict], field: str) -> dict:
    values = [r[field] for r in by_rank if r.get(field) is not None]
    return {f"{field}_median": float(statistics.median(values)) if values else None,
            f"{field}_max": max(values) if values else None}


def startup_summary(by_rank: list[dict]) -> dict:
    """The run summary's start-up fields: median and slowest rank of the start-up and of each of its parts
    (``Startup.PARTS``; None where no rank had the part), and every rank's split."""
    met = [r["rendezvous_s"] for r in by_rank if r.get("rendezvous_s") is not None]
    parts = {name: value for part in Startup.PARTS for name, value in _median_and_max(by_rank, part).items()}
    return {
        **_median_and_max(by_rank, "startup_s"),
        "rendezvous_s_max": max(met) if met else None,
        **parts,
        "startup_by_rank": sorted(by_rank, key=lambda r: r["rank"]),
    }
