"""This rank's line to the rest of its job while the edits run: shared decisions, stop requests,
progress, and the end of the run.

It all goes through the rendezvous store that the ranks met at, not through the compute
backend, so asking costs no device synchronisation and works whichever backend runs the model:

- ``share``: a decision rank 0 makes alone (which edits are already done) reaches every rank
  as rank 0 made it, or the same user error is raised on every rank;
- ``should_stop``: a stop signal that reached any rank reaches them all; the ranks of a replica
  then agree (``agree``, an all-reduce on the replica's control group) on the step to stop at;
- ``beat``: every denoising step says this rank is alive and where it is;
- ``end_of_run``: rank 0 waits until every rank has finished its edits, and fails the job
  naming a rank that made no progress for ``launcher.collective_timeout_s`` instead of waiting
  for it forever.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

from ditrun.errors import UserError
from ditrun.launch.rendezvous import format_ranks
from ditrun.launch.stop import StopRequest

STOP_REQUESTED = "ditrun/stop_requested"
SHARED = "ditrun/decided/"
BEAT = "ditrun/beat/"
AT_END = "ditrun/at_end/"
END_POLL_S = 0.2


class RankStuck(RuntimeError):
    """A rank stopped making progress while the others had finished the run."""


def job_of_process_group(stall_timeout_s: float) -> "LocalJob":
    """The job of a process that ``torch.distributed`` joined without ditrun's launcher (tests,
    embedding): the default group's store carries the job; no signal handling is installed."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return LocalJob()
    store = dist.distributed_c10d._get_default_store()  # no public accessor in torch 2.x
    return StoreJob(store, dist.get_rank(), dist.get_world_size(), StopRequest(), stall_timeout_s)


class LocalJob:
    """A run of one process: nothing to share, nobody to wait for."""

    rank = 0
    world = 1

    def __init__(self, stop: Optional[StopRequest] = None):
        self.stop = stop or StopRequest()

    def share(self, key: str, decide: Callable[[], object]):
        return decide()

    def should_stop(self, agree: Optional[Callable[[int], int]] = None) -> Optional[int]:
        """The signal to stop on, the same on every rank of the replica, or None to go on."""
        signum = self.stop.signum or 0
        signum = agree(signum) if agree is not None else signum
        return signum or None

    def beat(self, where: str) -> None:
        pass

    def end_of_run(self) -> None:
        pass


class StoreJob(LocalJob):
    """A rank of a multi-process job, talking to the others through the rendezvous store."""

    def __init__(self, store, rank: int, world: int, stop: StopRequest, stall_timeout_s: float):
        super().__init__(stop)
        self.store, self.rank, self.world = store, rank, world
        self.stall_timeout_s = stall_timeout_s
        self._posted = False
        self._beats = 0

    def share(self, key: str, decide: Callable[[], object]):
        if self.rank == 0:
            try:
                value = decide()
            except UserError as err:
                self.store.set(SHARED + key, json.dumps({"error": str(err)}))
                raise
            self.store.set(SHARED + key, json.dumps({"value": value}))
            return value
        message = json.loads(self.store.get(SHARED + key))
        if "error" in message:
            raise UserError(message["error"])
        return message["value"]

    def should_stop(self, agree=None) -> Optional[int]:
        if self.stop.signum is not None and not self._posted:
            # Tell every rank, including the other replicas' (Ctrl-C may reach one process only).
            self.store.set(STOP_REQUESTED, f"{self.stop.signum}\trank {self.rank} {self.stop.reason}")
            self._posted = True
        elif self.stop.signum is None and self.store.check([STOP_REQUESTED]):
            signum, reason = self.store.get(STOP_REQUESTED).decode().split("\t", 1)
            self.stop.request(int(signum), reason)
            self._posted = True
        return super().should_stop(agree)

    def beat(self, where: str) -> None:
        self._beats += 1
        self.store.set(f"{BEAT}{self.rank}", f"{self._beats}\t{where}")

    def end_of_run(self) -> None:
        """Say this rank is done, then wait: rank 0 for every rank, the others for rank 0 (so
        that a stuck rank 0 is named too). Raises ``RankStuck`` naming a rank that stalled."""
        self.store.set(f"{AT_END}{self.rank}", "1")
        self._wait_for(list(range(self.world)) if self.rank == 0 else [0])

    def _wait_for(self, ranks: list[int]) -> None:
        # Only a rank inside its edit loop is judged: its first beat is its first denoising step
        # (loading a model or compiling may take longer than any collective).
        last_seen: dict[int, tuple[str, float]] = {}
        while True:
            waiting = [r for r in ranks if not self.store.check([f"{AT_END}{r}"])]
            if not waiting:
                return
            now = time.monotonic()
            for rank in waiting:
                beat = self._beat_of(rank)
                if beat is None:
                    continue
                if last_seen.get(rank, (None,))[0] != beat:
                    last_seen[rank] = (beat, now)
                elif now - last_seen[rank][1] > self.stall_timeout_s:
                    raise RankStuck(self._stuck_message(rank, beat))
            time.sleep(END_POLL_S)

    def _beat_of(self, rank: int) -> Optional[str]:
        key = f"{BEAT}{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _stuck_message(self, rank: int, beat: str) -> str:
        finished = [r for r in range(self.world) if self.store.check([f"{AT_END}{r}"])]
        where = beat.split("\t", 1)[1]
        return (f"rank {rank} made no progress for {self.stall_timeout_s:g} s (launcher.collective_timeout_s) "
                f"while {format_ranks(finished)} had finished; it was last seen after {where}.")
