"""The CPU backend of ``copy_engine``: regions in shared-memory files, a thread per peer as its copy engine.

Each rank creates one file (in ``/dev/shm`` where there is one), the group swaps the names over
the process group, every rank maps the files of its node's peers (``mmap`` shared), and once all
have mapped them each rank unlinks its own: nothing is left behind even if a rank is killed.
A file is created 0600 (only this user can map it: it holds the exchanged activations), ``O_EXCL`` and
``O_NOFOLLOW`` (nothing planted under its name is used).
"""

from __future__ import annotations

import os
import tempfile
import uuid

import torch
import torch.distributed as dist

from ditrun.transport.lanes import InlineLane, ThreadLane

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedMemoryRegion:
    """One byte tensor and one int32 flag array per mapped peer (None for a peer on another node)."""

    def __init__(self, regions: list):
        self._bytes = regions
        self._flags = [None if r is None else r.view(torch.int32).numpy() for r in regions]

    def bytes(self, rank: int) -> torch.Tensor:
        return self._bytes[rank]

    def flags(self, rank: int):
        return self._flags[rank]


class SharedMemoryFabric:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def map(self, nbytes: int, group, local: list[bool], flag_count: int) -> SharedMemoryRegion:
        path = os.path.join(SHM_DIR, f"ditrun-copy-engine-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # zero-filled: every flag starts at epoch 0
        finally:
            os.close(fd)
        try:
            names: list = [None] * len(local)
            dist.all_gather_object(names, path, group=group)
            regions = [
                torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8) if here else None
                for name, here in zip(names, local)
            ]
            dist.barrier(group=group)  # every peer holds its mappings: the names may go
        finally:
            os.unlink(path)
        return SharedMemoryRegion(regions)

    def compute_lane(self, lanes: list) -> InlineLane:
        return InlineLane(self.timeout_s, lanes)

    def peer_lane(self, name: str, chaos_s: float, seed: int) -> ThreadLane:
        return ThreadLane(name, self.timeout_s, chaos_s, seed)

    def drain(self, lanes: list) -> None:
        for lane in lanes:
            if lane is not None:
                lane.close()
