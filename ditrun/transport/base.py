"""The transport protocol: start an all-to-all over one process-group axis, wait for it later.

``start`` is called on the compute stream once the data to send is ready and returns at once
with a ``Handle``; ``Handle.wait`` makes the compute stream wait for the received data and
returns it. Between the two the exchange runs on the transport's own stream (GPUs) or threads
(CPUs), so the caller can compute something else: that is how head groups overlap. Every wait
is timed through ``ExposedTransfer.timed`` so the run reports how long compute really stalled.

Buffers are row-major along dim 0: ``send`` holds ``send_splits[j]`` rows for peer ``j``, one
after the other; the received buffer holds ``recv_splits[j]`` rows from peer ``j``. Splits may be
uneven (a sequence that the group size does not divide), and may be 0.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ditrun.metrics.timing import ExposedTransfer
from ditrun.errors import UserError


class Handle(Protocol):
    def wait(self) -> torch.Tensor:
        """Make the compute stream wait for the exchange; returns the received rows."""


class Transport(Protocol):
    size: int
    """Ranks along the axis."""
    rank: int
    """This rank's index along the axis."""

    def start(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
              kind: str, group: int = 0) -> Handle:
        """Start the exchange; ``kind`` and ``group`` (head group) label the timed wait."""


class Ready:
    """A handle whose data is already here (an axis of one rank: nothing moves, nothing waits)."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def wait(self) -> torch.Tensor:
        return self.data


class LocalTransport:
    """The transport of an axis of size 1: the received rows are the sent rows."""

    size = 1
    rank = 0

    def start(self, send, send_splits, recv_splits, kind, group=0) -> Handle:
        return Ready(send)


def make_transport(name: str, group, timer: ExposedTransfer) -> Transport:
    """The transport ``name`` over ``group`` (None: an axis of one rank)."""
    if group is None:
        return LocalTransport()
    if name == "collective":
        from ditrun.transport.collective import CollectiveTransport

        return CollectiveTransport(group, timer)
    raise UserError(f"transport={name!r} is not available; allowed: collective.")


def all_gather_rows(transport: Transport, rows: torch.Tensor, sizes: Sequence[int], kind: str) -> Handle:
    """Every rank's ``rows`` (``sizes[j]`` of them on rank ``j``), concatenated in rank order.

    rows: [sizes[rank], ...] -> [sum(sizes), ...]. An all-to-all in which each rank sends the
    same rows to every peer, so that it runs on any transport.
    """
    send = rows.unsqueeze(0).expand(transport.size, *rows.shape).reshape(-1, *rows.shape[1:])
    return transport.start(send, [rows.shape[0]] * transport.size, sizes, kind)
