"""This rank's line to the rest of its job while the edits run: shared decisions, stop requests,
progress, and the end of the run.

It all goes through the rendezvous store that the ranks met at, not through the compute
backend, so asking costs no device synchronisation and works whichever backend runs the model:

- ``share``: a decision rank 0 makes alone (which edits are already done) reaches every rank
  as rank 0 made it, or the same user error is raised on every rank;
- stop requests: a stop signal that reached any rank reaches them all (the heartbeat thread
  posts this rank's and picks up the others'); in the edit loop the ranks of a replica then agree
  (``should_stop``: ``agree``, an all-reduce on the replica's control group) on the step to stop at;
- ``barrier``: between the phases of loading, every rank waits for all the others, and all go on
  or all stop, so that no rank enters a collective that a stopped peer will never join;
- ``beat``: every denoising step says this rank is alive and where it is;
- ``end_of_run``: rank 0 waits until every rank has finished its edits, and fails the job
  naming a rank that made no progress for ``launcher.collective_timeout_s`` instead of waiting
  for it forever;
- ``post`` / ``collect``: each rank's small facts (its start-up) reach rank 0 for the summary;
- ``sign_out``: the job's last wait, after which rank 0 (which serves the store) may exit.

No wait without a deadline: every wait on another rank polls the store, and fails naming a rank
whose heartbeat has not moved for ``launcher.collective_timeout_s``; every store request of this
job is bounded by the same timeout (``BoundedStore``: TCPStore's own timeout bounds waiting for a
key, not a request to a host that stopped answering, which waits forever), so a store host that
stopped answering (rank 0 frozen, its node gone) is named too, instead of being waited for.

Lost nodes: every rank's heartbeat thread counts up a key of its own twice a second. When a rank
fails, it first looks (``explain``) for ranks whose heartbeat stopped: a dead process or node
usually surfaces on the others as a collective's connection error, which names neither, so the
failure is reported as ``NodeLost`` naming the host names (from the rendezvous) and the ranks.
A failing rank whose store requests go unanswered names the store's host instead. The heartbeats
cost the store ``4 x world`` requests a second (an increment and a look for a stop request per
beat: about 2000 at 512 ranks, far below what one TCPStore serves).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

from ditrun.errors import UserError
from ditrun.launch import faults
from ditrun.launch.faults import describe
from ditrun.launch.rendezvous import ARRIVED, FINISHED, NODES, format_ranks, nodes_of
from ditrun.launch.stop import FAULT, NodeFault, StopRequest, stop_of

STOP_REQUESTED = "ditrun/stop_requested"
SHARED = "ditrun/decided/"
BEAT = "ditrun/beat/"
AT_END = "ditrun/at_end/"
POSTED = "ditrun/posted/"
ALIVE = "ditrun/alive/"
BARRIER = "ditrun/barrier/"
SEEN_END = "ditrun/seen_end/"
GO = "go"
END_POLL_S = 0.2
HEARTBEAT_S = 0.5
# A failing rank watches the others' heartbeats this long: several beats, so that a live rank
# whose thread waited for the interpreter lock a moment is not taken for a lost one.
LOST_WINDOW_S = 2.0


class StoreUnanswered(RuntimeError):
    """A store request got no answer within its bound: the store's host is frozen or gone."""


class BoundedStore:
    """A store connection whose every request is answered within ``timeout_s`` or raises ``StoreUnanswered``.

    The requests run one at a time on a thread of the connection's own; a request to a host that never
    answers leaves that thread behind (a daemon: it ends with the process), not the caller.
    """

    def __init__(self, store, timeout_s: float):
        self._store, self.timeout_s = store, timeout_s
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="ditrun-store-requests").start()

    def close(self) -> None:
        """End the request thread once the requests already asked are answered."""
        self._requests.put(None)

    def _serve(self) -> None:
        while (item := self._requests.get()) is not None:
            request, args, answer, answered = item
            try:
                answer.append(getattr(self._store, request)(*args))
            except BaseException as err:  # handed to the caller, whatever it is
                answer.append(err)
            answered.set()

    def _ask(self, request: str, *args):
        answer, answered = [], threading.Event()
        self._requests.put((request, args, answer, answered))
        if not answered.wait(self.timeout_s):
            raise StoreUnanswered(f"no answer to a store request ({request}) within {self.timeout_s:g} s")
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    def set(self, key: str, value) -> None:
        self._ask("set", key, value)

    def get(self, key: str) -> bytes:
        return self._ask("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._ask("add", key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._ask("compare_set", key, expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._ask("multi_get", keys)


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
        self._posted_values: dict = {}

    def share(self, key: str, decide: Callable[[], object]):
        return decide()

    def barrier(self, name: str) -> None:
        """A stop point between phases; with other ranks, all wait for each other, then all go on or all stop."""
        self.stop.check()

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
        self._posted_values[key] = value

    def collect(self, key: str) -> list:
        """Every rank's posted ``key``, by rank (global rank 0 only, after ``end_of_run``)."""
        return [self._posted_values[key]]

    def explain(self, err: BaseException) -> BaseException:
        """The failure to report for ``err``: a ``NodeLost`` when other ranks have gone silent."""
        return err


class StoreJob(LocalJob):
    """A rank of a multi-process job, talking to the others through the rendezvous store."""

    def __init__(
        self, store, rank: int, world: int, stop: StopRequest, stall_timeout_s: float, store_host: str = "rank 0"
    ):
        super().__init__(stop)
        self._raw_store = store
        if hasattr(store, "clone"):
            # A connection of its own whose every request is bounded: a store host that stopped answering
            # is named after launcher.collective_timeout_s, not waited for.
            store = store.clone()
            store.set_timeout(timedelta(seconds=stall_timeout_s))
            store = BoundedStore(store, stall_timeout_s)
        self.store, self.rank, self.world = store, rank, world
        self.stall_timeout_s = stall_timeout_s
        self.store_host = store_host
        self.store_lost = False
        self._posted = False
        self._beats = 0
        self._heart: Optional[threading.Thread] = None
        self._hosts: Optional[list[str]] = None

    def start_heartbeat(self) -> "StoreJob":
        """Count up this rank's heartbeat and pass stop requests both ways, from a thread of its own on its own
        connection, until ``stop_heartbeat`` (or until its connection closes)."""
        self._hosts = self.hosts()  # read while the store surely answers: messages name the hosts later
        self._heart_stop, self._answered = threading.Event(), time.monotonic()
        heart_store = BoundedStore(self._raw_store.clone(), self.stall_timeout_s)
        self._heart = threading.Thread(
            target=self._heartbeat, args=(heart_store,), daemon=True, name=f"ditrun-heartbeat-{self.rank}"
        )
        self._heart.start()
        return self

    def stop_heartbeat(self) -> None:
        """End the heartbeat thread before the process does (one inside a request to a store that stopped
        answering is left to end with the process)."""
        if self._heart is not None:
            self._heart_stop.set()
            self._heart.join(0 if self.store_lost else self.stall_timeout_s)

    def _heartbeat(self, store) -> None:
        try:
            while not self._heart_stop.is_set():
                store.add(f"{ALIVE}{self.rank}", 1)
                self._answered = time.monotonic()
                self._relay_stop(store)
                self._heart_stop.wait(HEARTBEAT_S)
            store.close()
        except StoreUnanswered:
            # Rank 0 froze (or its node went away) while this rank may be working alone for an hour: end
            # that work now (``StopRequest.fail``), naming it, rather than at this rank's next wait.
            self.stop.fail(self._store_lost())
        except RuntimeError:
            return  # the connection closed: the store's host is gone (the watchdog says so)

    def _relay_stop(self, store) -> None:
        """Post this rank's stop request for every rank, or take one that another rank posted."""
        if self._posted:
            return
        if self.stop.signum is not None:
            # Tell every rank, including the other replicas' (Ctrl-C may reach one process only).
            store.set(STOP_REQUESTED, f"{self.stop.signum}\trank {self.rank} {self.stop.reason}")
            self._posted = True
        elif store.check([STOP_REQUESTED]):
            signum, reason = store.get(STOP_REQUESTED).decode().split("\t", 1)
            self.stop.request(int(signum), reason)
            self._posted = True
            self.stop.interrupt()

    def share(self, key: str, decide: Callable[[], object]):
        if self.rank == 0:
            try:
                value = decide()
            except UserError as err:
                self.store.set(SHARED + key, json.dumps({"error": str(err)}))
                raise
            except NodeFault as fault:  # every rank stops with it
                self.store.set(SHARED + key, json.dumps({"fault": f"rank {self.rank} {fault.reason}"}))
                raise
            self.store.set(SHARED + key, json.dumps({"value": value}))
            return value
        self._await(lambda: self.store.check([SHARED + key]), lambda: [0])
        message = json.loads(self.store.get(SHARED + key))
        if "error" in message:
            raise UserError(message["error"])
        if "fault" in message:
            raise stop_of(FAULT, message["fault"])
        return message["value"]

    def barrier(self, name: str) -> None:
        """Wait for every rank at ``name``; one outcome for all, kept on the store: ``go`` once every rank
        has arrived, or the stop that a rank requested first (also one that never arrives because a stop
        ended its phase early). Rank 0 watches every rank that has not arrived, the others watch rank 0."""
        key = f"{BARRIER}{name}"
        self.store.set(f"{key}/{self.rank}", "1")
        if self.store.add(f"{key}/count", 1) == self.world:
            self.store.compare_set(key, "", GO)

        def decided() -> bool:
            if self.stop.signum is not None:
                self.store.compare_set(key, "", f"{self.stop.signum}\t{self.stop.reason}")
            return self.store.check([key])

        self._await(decided, lambda: self._missing(f"{key}/") if self.rank == 0 else [0])
        outcome = self.store.get(key).decode()
        if outcome != GO:
            signum, reason = outcome.split("\t", 1)
            self.stop.request(int(signum), reason)
            self.stop.check()

    def beat(self, where: str) -> None:
        self._beats += 1
        self.store.set(f"{BEAT}{self.rank}", f"{self._beats}\t{where}")

    def end_of_run(self) -> None:
        """Say this rank is done, then wait: rank 0 for every rank, the others for rank 0 (so
        that a stuck rank 0 is named too). Raises ``RankStuck`` naming a rank that stalled."""
        self.store.set(f"{AT_END}{self.rank}", "1")
        ranks = list(range(self.world)) if self.rank == 0 else [0]

        def waiting() -> list[int]:
            return [r for r in ranks if not self.store.check([f"{AT_END}{r}"])]

        self._await(lambda: not waiting(), waiting, self._stuck_judge())

    def sign_out(self, watchdog) -> None:
        """The job's last wait (its heartbeat stopped): rank 0 waits until every rank has signed out, ends
        the watchdogs (``faults.release``), then stays until every rank has seen that, so that nobody loses
        the store it serves mid-request; the others wait for the release while rank 0 lives."""
        self.store.set(f"{FINISHED}{self.rank}", "1")
        if self.rank == 0:
            self._await(lambda: not self._missing(FINISHED), lambda: self._missing(FINISHED))
            faults.release(self.store)
            watchdog.join(self.stall_timeout_s)
            self._await(lambda: not self._missing(SEEN_END, [0]), lambda: self._missing(SEEN_END, [0]))
            return
        self._await(lambda: watchdog.join(END_POLL_S), lambda: [0])
        self.store.set(f"{SEEN_END}{self.rank}", "1")

    def post(self, key: str, value) -> None:
        self.store.set(f"{POSTED}{key}/{self.rank}", json.dumps(value))

    def collect(self, key: str) -> list:
        return [json.loads(self.store.get(f"{POSTED}{key}/{rank}")) for rank in range(self.world)]

    def _missing(self, prefix: str, exclude: list[int] = ()) -> list[int]:
        """The ranks without a ``<prefix><rank>`` key."""
        return [r for r in range(self.world) if r not in exclude and not self.store.check([f"{prefix}{r}"])]

    def _await(
        self,
        done: Callable[[], bool],
        watched: Callable[[], list[int]],
        judge: Optional[Callable[[list[int], float], None]] = None,
    ) -> None:
        """Poll until ``done()``; fail naming a ``watched()`` rank whose heartbeat has not moved for
        ``launcher.collective_timeout_s`` (``judge`` may fail sooner), or the store's host if a request
        to it went unanswered that long."""
        last_alive: dict[int, tuple[int, float]] = {}
        try:
            while not done():
                now, waiting = time.monotonic(), watched()
                silent = [r for r in waiting if self._silent_since(r, now, last_alive) > self.stall_timeout_s]
                if silent:
                    raise NodeLost(self._lost_message(silent, self.stall_timeout_s))
                if judge is not None:
                    judge(waiting, now)
                time.sleep(END_POLL_S)
        except RuntimeError as err:
            if isinstance(err, (RankStuck, NodeLost)):
                raise
            raise self._store_lost() from None

    def _stuck_judge(self) -> Callable[[list[int], float], None]:
        """Fail naming a waited-for rank whose denoising steps stopped. Only a rank inside its edit loop is
        judged: its first beat is its first denoising step (loading a model or compiling may take longer than
        any collective). A rank whose heartbeat stopped is lost wherever it was (``_await``)."""
        last_seen: dict[int, tuple[str, float]] = {}

        def judge(waiting: list[int], now: float) -> None:
            for rank in waiting:
                beat = self._beat_of(rank)
                if beat is None:
                    continue
                if last_seen.get(rank, (None,))[0] != beat:
                    last_seen[rank] = (beat, now)
                elif now - last_seen[rank][1] > self.stall_timeout_s:
                    raise RankStuck(self._stuck_message(rank, beat))

        return judge

    def _store_lost(self) -> "NodeLost":
        self.store_lost = True
        hosts = self._hosts or []
        where = f" on {hosts[0]}" if hosts and self.store_host == "rank 0" else ""
        return NodeLost(
            f"{self.store_host}{where}, which serves the rendezvous store, stopped answering: no reply "
            f"for {self.stall_timeout_s:g} s (launcher.collective_timeout_s); its process is frozen or "
            f"its node went away"
        )

    def _store_answers(self) -> bool:
        """Whether the store's host still answers: the heartbeat thread's next request gets a reply (at once,
        on a live store) within launcher.collective_timeout_s of its last one."""
        if self._heart is None:
            return True
        asked = time.monotonic()
        while self._heart.is_alive() and time.monotonic() - self._answered < self.stall_timeout_s:
            if self._answered > asked:
                return True
            time.sleep(END_POLL_S / 4)
        return False

    def report(self, failure: BaseException) -> None:
        """Post this rank's failure for every watchdog, unless the store's host is the one that is gone."""
        if not self.store_lost:
            faults.report(self.store, self.rank, failure)

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
        if isinstance(err, StoreUnanswered):
            return self._store_lost()
        try:
            if not self._store_answers():
                raise StoreUnanswered("the heartbeat got no answer")
            silent = self._silent_ranks(LOST_WINDOW_S)
        except RuntimeError:
            return NodeLost(f"{self._store_lost()}; rank {self.rank} then failed: {describe(err)}")
        return (
            NodeLost(f"{self._lost_message(silent, LOST_WINDOW_S)}; rank {self.rank} then failed: {describe(err)}")
            if silent
            else err
        )

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
        if self._hosts is not None:
            return self._hosts
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
            lost.append(
                f"node {host} ({format_ranks(gone)}, all of its ranks)"
                if gone == on_host
                else f"{format_ranks(gone)} on {host}"
            )
        return f"lost {'; '.join(lost)}: no heartbeat for {seconds:g} s (the processes died or their node went away)"

    def _beat_of(self, rank: int) -> Optional[str]:
        key = f"{BEAT}{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _stuck_message(self, rank: int, beat: str) -> str:
        finished = [r for r in range(self.world) if self.store.check([f"{AT_END}{r}"])]
        where = beat.split("\t", 1)[1]
        return (
            f"rank {rank} made no progress for {self.stall_timeout_s:g} s (launcher.collective_timeout_s) "
            f"while {format_ranks(finished)} had finished; it was last seen on {self.hosts()[rank]} after {where}."
        )
