"""Lanes: ordered queues of the copy-engine transport's four operations, one per peer plus compute.

The schedule (``copy_engine.py``) speaks only to lanes: ``copy`` rows into a peer's slot,
``write_value`` an epoch or credit into a flag, ``wait_value`` until a flag reaches a value,
``mark`` a point that another lane can wait for. A lane runs its operations in order, after
whatever it was asked to ``follow`` (a mark of another lane: the compute lane's mark taken once
per exchange, so each copy waits for the rows it sends and for nothing issued later). Two kinds:

* CPU: ``ThreadLane`` is one thread per peer, the stand-in for a copy engine, running its queue;
  ``InlineLane`` is the compute thread itself (CPU compute is synchronous, so it runs at once).
  Flags live in shared memory and are polled with a short back-off. On x86 (total store order)
  a flag written after the rows is never seen before them; weaker CPUs would need a fence.
* GPU: ``StreamLane`` wraps a CUDA/HIP stream (a dedicated one per peer, or the compute stream):
  copies are plain device-to-device memcpys into peer-mapped memory, writes are stream
  write-value operations, waits are stream wait-value operations (``device_wait.py``), so
  nothing on the critical path goes through the host.

Every wait has a deadline; a flag that does not arrive becomes ``PeerLost`` naming the peer.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ditrun.transport.base import PeerLost

Describe = Callable[[float], str]
"""Builds the sentence of a timeout (given its seconds): which rank waited, for what, from which peer."""


def poll_at_least(
    flags: np.ndarray, index: int, value: int, timeout_s: float, describe: Describe, lanes: Sequence = ()
) -> None:
    """Spin (backing off to 1 ms) until ``flags[index] >= value``; ``PeerLost`` after ``timeout_s``.

    A failure of one of ``lanes`` (the copy lanes this wait depends on) is raised at once.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.0
    while flags[index] < value:
        raise_lane_error(lanes)
        if time.monotonic() > deadline:
            raise PeerLost(describe(timeout_s))
        time.sleep(delay)
        delay = min(max(2 * delay, 1e-5), 1e-3)


class InlineLane:
    """The compute thread on a CPU: every operation runs now."""

    def __init__(self, timeout_s: float, lanes: Sequence = ()):
        self.timeout_s = timeout_s
        self.lanes = lanes
        """The copy lanes whose failures a wait raises at once."""
        self.error: Optional[BaseException] = None

    def follow(self, mark) -> None:
        """Run what comes next only after ``mark``; a CPU's compute is synchronous, so its marks are passed."""

    def mark(self):
        """A point another lane can follow: None on the compute thread, whose operations are already done."""
        return None

    def hold(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` alive until this lane's queued copies out of it are done (the queued closure does)."""

    def wait_value(self, flags: np.ndarray, index: int, value: int, describe: Describe) -> None:
        poll_at_least(flags, index, value, self.timeout_s, describe, self.lanes)

    def write_value(self, flags: np.ndarray, index: int, value: int) -> None:
        flags[index] = value

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def wait_marks(self, marks: list, lanes: list) -> None:
        """Wait until every lane has passed its mark (its copies out of a send slot are done)."""
        for mark in marks:
            # Twice the timeout: a lane stuck on a lost peer times out first, and names it.
            if not mark.wait(2 * self.timeout_s):
                raise PeerLost("a copy lane did not finish its copies within the timeout")
        raise_lane_error(lanes)


def raise_lane_error(lanes: list) -> None:
    """Re-raise, on the compute thread, the first failure of a copy lane (a peer that stopped answering)."""
    for lane in lanes:
        if lane is not None and lane.error is not None:
            raise lane.error


class ThreadLane(InlineLane):
    """One peer's copy engine on a CPU: a thread that runs its queue in order.

    ``chaos_s`` > 0 sleeps a random time up to it before each copy, so tests see copies finish in
    every order; after a failure the lane only passes its marks (so no waiter hangs on it) and
    the compute thread re-raises the failure.
    """

    def __init__(self, name: str, timeout_s: float, chaos_s: float = 0.0, seed: int = 0):
        super().__init__(timeout_s)
        self.chaos_s, self.random = chaos_s, random.Random(seed)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @torch.inference_mode()  # like the compute thread: slots may be inference tensors, never autograd's
    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, always = job
            if self.error is not None and not always:
                continue
            try:
                fn()
            except BaseException as err:  # kept for the compute thread, which raises it
                self.error = err

    def wait_value(self, flags, index, value, describe) -> None:
        self.jobs.put((lambda: poll_at_least(flags, index, value, self.timeout_s, describe), False))

    def write_value(self, flags, index, value) -> None:
        self.jobs.put((lambda: flags.__setitem__(index, value), False))

    def copy(self, dst, src) -> None:
        self.jobs.put((lambda: self._copy(dst, src), False))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.chaos_s:
            time.sleep(self.random.uniform(0, self.chaos_s))
        dst.copy_(src)

    def mark(self) -> threading.Event:
        event = threading.Event()
        self.jobs.put((event.set, True))
        return event

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(self.timeout_s)
