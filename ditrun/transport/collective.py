"""The ``collective`` transport: ``all_to_all_single`` of the process group's backend.

NCCL (CUDA) and RCCL (ROCm) run an ``async_op`` collective on the library's own stream, ordered
after the work already queued on the compute stream when it is started; ``Work.wait`` then
inserts a wait into the compute stream only, so the host never blocks and the compute stream
stalls only where the data is needed. On gloo (CPUs) the exchange runs on gloo's threads and
``Work.wait`` blocks the calling thread until the data has arrived.

It owns no buffers: ``prepare`` has nothing to do, each send buffer and each received tensor is
a fresh allocation (the caching allocator recycles them), and ``release`` only drops them.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ditrun.timers import ExposedTransfer
from ditrun.transport.base import ExchangeShape, SentBytes, fresh_send_buffer


class CollectiveHandle:
    def __init__(
        self, work, recv: torch.Tensor, send: torch.Tensor, timer: ExposedTransfer, kind: str, head_group: int
    ):
        # The send buffer is kept alive until the wait, whatever the backend does with it.
        self.work, self.recv, self.send = work, recv, send
        self.timer, self.kind, self.head_group = timer, kind, head_group

    def wait(self) -> torch.Tensor:
        with self.timer.timed(self.kind, self.head_group):
            self.work.wait()
        self.send = None
        return self.recv

    def release(self) -> None:
        self.recv = None


class CollectiveTransport:
    """All-to-all over one process group with the group's own collective library."""

    def __init__(self, group, timer: ExposedTransfer, device: torch.device):
        self.group, self.timer, self.device = group, timer, device
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sent = SentBytes()

    def prepare(self, shapes: Sequence[ExchangeShape]) -> None:
        pass

    def send_buffer(self, shape: ExchangeShape, head_group: int = 0) -> torch.Tensor:
        return fresh_send_buffer(shape, self.rank, self.device)

    def start(self, send: torch.Tensor, shape: ExchangeShape, head_group: int = 0) -> CollectiveHandle:
        # send: [sum(send_splits), *row] -> received: [sum(recv_splits), *row]
        send = send.contiguous()
        self.sent.add(send, shape, self.rank)
        recv = send.new_empty((sum(shape.recv_splits(self.rank)), *send.shape[1:]))
        work = dist.all_to_all_single(
            recv, send, shape.recv_splits(self.rank), shape.send_splits(self.rank), group=self.group, async_op=True
        )
        return CollectiveHandle(work, recv, send, self.timer, shape.kind, head_group)
