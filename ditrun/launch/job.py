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
  for it forever;
- ``post`` / ``collect``: each rank's small facts (its start-up) reach rank 0 for the summary.

Lost nodes: every rank's heartbeat thread counts up a key of its own twice a second. When a rank
fails, it first looks (``explain``) for ranks whose heartbeat stopped: a dead process or node
usually surfaces on the others as a collective's connection error, which names neither, so the
failure is reported as ``NodeLost`` naming the host names (from the rendezvous) and the ranks.
The heartbeats cost the store ``2 x world`` increments a second (about 1000 at 512 ranks, far
below what one TCPStore serves).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Optional

from ditrun.errors import UserError
from ditrun.launch.faults import describe
from ditrun.launch.rendezvous import ARRIVED, NODES, format_ranks, nodes_of
from ditrun.launch.stop import StopRequest

STOP_REQUESTED = "ditrun/stop_requested"
SHARED = "ditrun/decided/"
BEAT = "ditrun/beat/"
AT_END = "ditrun/at_end/"
POSTED = "ditrun/posted/"
ALIVE = "ditrun/alive/"
END_POLL_S = 0.2
HEARTBEAT_S = 0.5
# A failing rank watches the others' heartbeats this long: several beats, so that a live rank
# whose thread waited for the interpreter lock a moment is not taken for a lost one.
LOST_WINDOW_S = 2.0


class RankStuck(RuntimeError):
    """A rank stopped making progress while the others had finished the run."""


class NodeLost(RuntimeError):
    """Ranks stopped answering (their heartbeats stopped): their processes or their node are gone."""


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

    def post(self, key: str, value) -> None:
        self._posted_value = value

    def collect(self, key: str) -> list:
        """Every rank's posted ``key``, by rank (global rank 0 only, after ``end_of_run``)."""
        return [self._posted_value]

    def explain(self, err: BaseException) -> BaseException:
        """The failure to report for ``err``: a ``NodeLost`` when other ranks have gone silent."""
        return err


class StoreJob(LocalJob):
    """A rank of a multi-process job, talking to the others through the rendezvous store."""

    def __init__(self, store, rank: int, world: int, stop: StopRequest, stall_timeout_s: float):
        super().__init__(stop)
        self.store, self.rank, self.world = store, rank, world
        self.stall_timeout_s = stall_timeout_s
        self._posted = False
        self._beats = 0

    def start_heartbeat(self) -> "StoreJob":
        """Count up this rank's heartbeat from a thread of its own, on its own connection, until the
        store goes away at the end of the job (or with this process)."""
        self._heart_stop = threading.Event()
        self._heart = threading.Thread(target=_heartbeat, args=(self.store.clone(), f"{ALIVE}{self.rank}",
                                                                self._heart_stop),
                                       daemon=True, name=f"ditrun-heartbeat-{self.rank}")
        self._heart.start()
        return self

    def stop_heartbeat(self) -> None:
        """End the heartbeat thread before the process does: none may sit in a store call then."""
        self._heart_stop.set()
        self._heart.join()

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

    def post(self, key: str, value) -> None:
        self.store.set(f"{POSTED}{key}/{self.rank}", json.dumps(value))

    def collect(self, key: str) -> list:
        return [json.loads(self.store.get(f"{POSTED}{key}/{rank}")) for rank in range(self.world)]

    def _wait_for(self, ranks: list[int]) -> None:
        # Only a rank inside its edit loop is judged stuck: its first beat is its first denoising
        # step (loading a model or compiling may take longer than any collective). A rank whose
        # heartbeat stopped is lost wherever it was.
        last_seen: dict[int, tuple[str, float]] = {}
        last_alive: dict[int, tuple[int, float]] = {}
        while True:
            waiting = [r for r in ranks if not self.store.check([f"{AT_END}{r}"])]
            if not waiting:
                return
            now = time.monotonic()
            silent = [rank for rank in waiting if self._silent_since(rank, now, last_alive) > self.stall_timeout_s]
            if silent:
                raise NodeLost(self._lost_message(silent, self.stall_timeout_s))
            for rank in waiting:
                beat = self._beat_of(rank)
                if beat is None:
                    continue
                if last_seen.get(rank, (None,))[0] != beat:
                    last_seen[rank] = (beat, now)
                elif now - last_seen[rank][1] > self.stall_timeout_s:
                    raise RankStuck(self._stuck_message(rank, beat))
            time.sleep(END_POLL_S)

    def _silent_since(self, rank: int, now: float, last_alive: dict[int, tuple[int, float]]) -> float:
        """Seconds since ``rank``'s heartbeat last moved (0 for a rank without one: a process group
        joined without ditrun's launcher)."""
        alive = self._alive_count(rank)
        if alive == 0 or last_alive.get(rank, (None,))[0] != alive:
            last_alive[rank] = (alive, now)
        return now - last_alive[rank][1]

    def explain(self, err: BaseException) -> BaseException:
        if isinstance(err, (UserError, RankStuck, NodeLost)):
            return err  # already says who
        try:
            silent = self._silent_ranks(LOST_WINDOW_S)
            return NodeLost(f"{self._lost_message(silent, LOST_WINDOW_S)}; rank {self.rank} then failed: "
                            f"{describe(err)}") if silent else err
        except RuntimeError:
            return err  # the store is gone with rank 0: the watchdogs say so

    def _silent_ranks(self, window_s: float) -> list[int]:
        # Ranks at the end of their run have stopped beating on purpose.
        others = [r for r in range(self.world) if r != self.rank and not self.store.check([f"{AT_END}{r}"])]
        before = {r: self._alive_count(r) for r in others}
        time.sleep(window_s)
        return [r for r in others if before[r] and self._alive_count(r) == before[r]]

    def _alive_count(self, rank: int) -> int:
        return self.store.add(f"{ALIVE}{rank}", 0)

    def hosts(self) -> list[str]:
        """Each rank's node as the placement names it (``parallel/placement.py``), else its host name
        as it signed in at ditrun's rendezvous (a process group joined without it has neither)."""
        if self.store.check([NODES]):
            return list(nodes_of(self.store))
        keys = [f"{ARRIVED}/{rank}" for rank in range(self.world)]
        return [self.store.get(key).decode() if self.store.check([key]) else "an unknown host" for key in keys]

    def _lost_message(self, silent: list[int], seconds: float) -> str:
        """``lost node n2 (ranks 2-3, all of its ranks)``, or ``lost rank 3 on n2``, and why."""
        hosts = self.hosts()
        lost = []
        for host in dict.fromkeys(hosts[r] for r in silent):
            on_host = [r for r, h in enumerate(hosts) if h == host]
            gone = [r for r in silent if hosts[r] == host]
            lost.append(f"node {host} ({format_ranks(gone)}, all of its ranks)" if gone == on_host
                        else f"{format_ranks(gone)} on {host}")
        return (f"lost {'; '.join(lost)}: no heartbeat for {seconds:g} s (the processes died or their "
                f"node went away)")

    def _beat_of(self, rank: int) -> Optional[str]:
        key = f"{BEAT}{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _stuck_message(self, rank: int, beat: str) -> str:
        finished = [r for r in range(self.world) if self.store.check([f"{AT_END}{r}"])]
        where = beat.split("\t", 1)[1]
        return (f"rank {rank} made no progress for {self.stall_timeout_s:g} s (launcher.collective_timeout_s) "
                f"while {format_ranks(finished)} had finished; it was last seen on {self.hosts()[rank]} after {where}.")


def _heartbeat(store, key: str, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            store.add(key, 1)
            stop.wait(HEARTBEAT_S)
    except RuntimeError:
        return  # the store is gone: the job ended, or rank 0 with it (the watchdog reports that)
