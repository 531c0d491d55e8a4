"""Local spawn: ``ditrun launcher.world=N`` outside any launcher starts N ranks on this machine.

Each rank is a fresh interpreter ("spawn", never "fork": a forked CUDA context is unusable)
started exactly as torchrun would start it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so it takes the same path through ``rank.run_as_rank`` as a rank
of any other launcher. This process only supervises: it returns rank 0's summary, or, when a
rank fails, stops the others and reports the rank that failed first.

A stop signal sent to this process (SIGTERM, SIGINT, SIGUSR1) is passed on to every rank, which
stop together in whatever phase they are (``stop.py``); ranks still running ``launcher.stop_timeout_s``
later are killed, and the command still exits as stopped (128 + N), never 0. If this process
itself is killed outright, each rank notices its parent is gone (``stop.py``) and stops the same way.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Optional

import torch

from ditrun import rank_entry
from ditrun.errors import UserError
from ditrun.launch import env, faults, rendezvous, secret
from ditrun.launch.stop import NodeFault, RunStopped, StopRequest
from ditrun.parallel.placement import format_ranks

# After the first rank fails, the others get this long to stop by themselves (their watchdogs
# end them within a second or two) before they are terminated.
STOP_GRACE_S = 5.0


def spawn_local(cfg, out_dir: Path, work, hydra_files=None) -> dict:
    """Run ``launcher.world`` ranks of ``work`` (``work.py``) here and wait for all of them."""
    world = cfg.launcher.world
    check_local_devices(cfg.device, world)
    port = cfg.launcher.master_port or env.free_port()
    job_secret = secret.new_secret()  # travels in the pipe to each rank: no other process sees it
    context = multiprocessing.get_context("spawn")
    # One pipe per rank, not a shared queue: a rank ended abruptly leaves no lock behind.
    pipes = [context.Pipe(duplex=False) for _ in range(world)]
    # The rank starts in ``rank_entry`` (standard library only), which catches stop signals before the
    # rank imports torch; its arguments travel pickled so that unpickling them is covered too.
    args = [(cfg, out_dir, work, rank, world, port, job_secret, os.getpid(), hydra_files) for rank in range(world)]
    payloads = [pickle.dumps(rank_args) for rank_args in args]
    ranks = [
        context.Process(
            target=rank_entry.rank_main,
            args=(payloads[rank], pipes[rank][1]),
            name=f"ditrun-rank-{rank}",
        )
        for rank in range(world)
    ]
    relay = Relay(ranks)
    stop = StopRequest().install(relay=relay)
    try:
        for process, (_, sender) in zip(ranks, pipes):
            process.start()
            sender.close()  # the rank holds the only sending end, so its exit closes the pipe
        return _supervise(ranks, [receiver for receiver, _ in pipes], stop, cfg.launcher.stop_timeout_s, relay)
    finally:
        stop.restore()
        _stop(ranks)


class Relay:
    """Passes this process's stop signals on to the ranks, which decide together when to stop.

    A rank gets a signal only once it has said that its handlers are installed (``rank_entry``
    sends "ready"): sent earlier, a SIGINT would interrupt the rank's imports and a SIGTERM kill it
    outright. A signal that came before a rank was ready is sent to it then.
    """

    def __init__(self, ranks):
        self.ranks, self.ready, self.signals = ranks, set(), []

    def __call__(self, signum: int) -> None:
        self.signals.append(signum)
        for rank in list(self.ready):
            self._send(rank, signum)

    def rank_ready(self, rank: int) -> None:
        self.ready.add(rank)
        for signum in list(self.signals):
            self._send(rank, signum)

    def _send(self, rank: int, signum: int) -> None:
        process = self.ranks[rank]
        if process.pid is not None and process.exitcode is None:
            os.kill(process.pid, signum)


def check_local_devices(device_key: str, world: int) -> None:
    """One rank per GPU: a machine with G GPUs runs at most G ranks on them."""
    if not rendezvous.uses_gpu(device_key):
        return
    gpus = torch.cuda.device_count()
    if world > gpus:
        raise UserError(
            f"launcher.world={world} but this machine has {gpus} GPUs (one rank per GPU); "
            f"set launcher.world to at most {gpus}, or device=cpu."
        )


def _supervise(ranks, receivers, stop: StopRequest, stop_timeout_s: float, relay: Relay) -> dict:
    """Wait for every rank; the first failure stops the rest, and so does a stop signal."""
    summary, reports, exits, stop_at, killed, at_once = None, [], [], None, [], False
    alive, open_pipes = list(ranks), list(receivers)
    while alive or open_pipes:
        ready = wait([p.sentinel for p in alive] + open_pipes, timeout=0.5)
        for receiver in [r for r in ready if r in open_pipes]:
            summary = _receive(receiver, open_pipes, reports, relay) or summary
        exits += [(ranks.index(p), p.exitcode) for p in alive if p.exitcode is not None]
        alive = [p for p in alive if p.exitcode is None]
        if stop_at is None and (_failed(reports) or any(code for _, code in exits)):
            stop_at = time.monotonic() + STOP_GRACE_S
        if stop_at is None and stop.signum is not None:
            stop_at = time.monotonic() + stop_timeout_s
        # ranks stopped by a signal (SIGSTOP, a debugger) cannot end by themselves: no need to wait for them
        at_once = bool(alive) and stop_at is not None and all(map(_suspended, alive))
        if alive and stop_at is not None and (time.monotonic() > stop_at or at_once):
            killed = [ranks.index(p) for p in alive]
            _stop(alive)  # the exit codes of ranks stopped here say nothing about the failure
            alive, open_pipes = [], []
    stops = {rank: payload for rank, payload, kind in reports if kind == "stopped"}  # each rank's RunStopped
    stopped = {payload.signum for payload in stops.values()}
    if stop.signum is not None:
        stopped.add(stop.signum)  # ranks the relayed signal reached before their handlers did die of it
    _raise_first_failure(
        [(rank, payload) for rank, payload, kind in reports if kind == "failed"],
        [
            (rank, code)
            for rank, code in exits
            if not (rank in stops and code == stops[rank].exit_code) and not _stopped_by(code, stopped)
        ],
    )
    fault = _node_fault(stops)
    if killed and at_once:
        why = f"{format_ranks(killed)} killed at once, stopped by a signal (SIGSTOP, a debugger)"
        if fault or stopped:
            raise fault or RunStopped(min(stopped), f" ({why})")
        raise faults.WorkerFailed(why + ".")
    if killed:  # the run's end (its summary) may be missing: never a success
        if fault or stopped:
            raise fault or RunStopped(
                min(stopped), f" ({format_ranks(killed)} killed after {stop_timeout_s:g} s, launcher.stop_timeout_s)"
            )
        raise faults.WorkerFailed(f"{format_ranks(killed)} killed {STOP_GRACE_S:g} s after another rank exited.")
    if stops or any(_stopped_by(code, stopped) for _, code in exits):
        raise fault or RunStopped(min(stopped))
    return summary


def _node_fault(stops: dict) -> Optional[NodeFault]:
    """The node fault that stopped the job, as the rank that found it says it (it names the file), if any."""
    found = [stop for _, stop in sorted(stops.items()) if isinstance(stop, NodeFault)]
    return next((stop for stop in found if stop.found_here), found[0] if found else None)


def _stopped_by(code: int, signals: set) -> bool:
    """An exit status that a stop signal explains: died of it (-N), or stopped on it (128 + N)."""
    return bool(code) and (-code in signals or code - 128 in signals)


def _failed(reports: list) -> bool:
    return any(kind == "failed" for _, _, kind in reports)


def _receive(receiver, open_pipes: list, reports: list, relay: Relay) -> dict | None:
    """One message from a rank (None when its pipe closed); rank 0's summary when it sends it."""
    try:
        kind, rank, *payload = receiver.recv()
    except EOFError:
        open_pipes.remove(receiver)
        return None
    if kind == "ready":
        relay.rank_ready(rank)
        return None
    if kind in ("failed", "stopped"):
        reports.append((rank, payload[0], kind))
        return None
    return payload[0] if rank == 0 else None


def _raise_first_failure(reports: list, exits: list) -> None:
    """Name the rank that failed first.

    A rank that vanished without a report (killed, crashed in native code) comes first: the
    ranks that then lost their connections to it report errors of their own, but they are
    its victims. Ranks that a watchdog stopped are victims too.
    """
    reported = {rank for rank, _ in reports}
    silent = [(rank, code) for rank, code in exits if code and code != faults.PEER_FAILED_EXIT and rank not in reported]
    if silent:
        rank, code = silent[0]
        raise faults.WorkerFailed(f"rank {rank} {_exit_description(code)} without reporting an error.")
    if reports:
        rank, error = reports[0]
        if isinstance(error, BaseException):
            raise error
        raise faults.WorkerFailed(f"rank {rank} failed: {error}")
    failed = [(rank, code) for rank, code in exits if code]
    if failed:
        rank, code = failed[0]
        raise faults.WorkerFailed(f"rank {rank} {_exit_description(code)}.")


def _exit_description(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _suspended(process) -> bool:
    """Whether ``process`` is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: it acts on no other signal until
    it is continued. Read from Linux's /proc; elsewhere (or once it has gone) False."""
    try:
        stat = Path(f"/proc/{process.pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].startswith(("T", "t"))


def _stop(processes) -> None:
    """Terminate, then kill, whatever is still running; a stopped process at once, as it cannot act on SIGTERM."""
    for process in processes:
        if process.exitcode is None:
            if _suspended(process):
                process.kill()
            else:
                process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.exitcode is None:
            process.kill()
            process.join(timeout=5)
