"""The ``collective`` transport: ``all_to_all_single`` of the process group's backend.

NCCL (CUDA) and RCCL (ROCm) run an ``async_op`` collective on the library's own stream, ordered
after the work already queued on the compute stream when it is started; ``Work.wait`` then
inserts a wait into the compute stream only, so the host never blocks and the compute stream
stalls only where the data is needed. On gloo (CPUs) the exchange runs on gloo's threads and
``Work.wait`` blocks the calling thread until the data has arrived.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ditrun.metrics.timing import ExposedTransfer


class CollectiveHandle:
    def __init__(self, work, recv: torch.Tensor, send: torch.Tensor, timer: ExposedTransfer, kind: str,
                 group: int):
        # The send buffer is kept alive until the wait, whatever the backend does with it.
        self.work, self.recv, self.send = work, recv, send
        self.timer, self.kind, self.group = timer, kind, group

    def wait(self) -> torch.Tensor:
        with self.timer.timed(self.kind, self.group):
            self.work.wait()
        self.send = None
        return self.recv


class CollectiveTransport:
    """All-to-all over one process group with the group's own collective library."""

    def __init__(self, group, timer: ExposedTransfer):
        self.group, self.timer = group, timer
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def start(self, send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
              kind: str, group: int = 0) -> CollectiveHandle:
        # send: [sum(send_splits), ...] -> received: [sum(recv_splits), ...]
        send = send.contiguous()
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        work = dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=self.group,
                                      async_op=True)
        return CollectiveHandle(work, recv, send, self.timer, kind, group)
