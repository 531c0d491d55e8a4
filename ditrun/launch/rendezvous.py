"""Rendezvous and devices: every rank binds its device, meets the others at rank 0's store, and
starts ``torch.distributed`` on that store.

The meeting is ditrun's own, on a ``TCPStore`` that rank 0 serves (or torchrun's agent, which
already serves one), rather than the one inside ``init_process_group``: each rank signs in
under its own key, so a rendezvous that does not
complete names the ranks that did not arrive instead of timing out anonymously. The same store
then carries the process group's own set-up, rank 0's choices that every rank must share (the
results directory), and the failure notices of ``ditrun.launch.faults``.

Each rank also signs in with its node: the launcher's name for it or its host name, and the
launcher's node number where there is one. Rank 0 collects them in one read and publishes the
list under one key, so the meeting costs every rank a constant number of store requests however
many nodes there are; ``ditrun.parallel.placement`` turns the list into the job's nodes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ditrun.errors import UserError
from ditrun.launch import secret
from ditrun.launch.env import RankInfo
from ditrun.launch.sealed import SealedStore
from ditrun.parallel.placement import format_ranks, node_names  # job.py imports format_ranks from here

KEY = "ditrun/"
ARRIVED = KEY + "arrived"
ALL_ARRIVED = KEY + "all_arrived"
NODE = KEY + "node/"
NODES = KEY + "nodes"
SHARED = KEY + "shared/"
FINISHED = KEY + "finished/"  # signed out (``job.StoreJob.sign_out``)
FAILED_PREFIX = "failed: "
# Other ranks wait this much longer than rank 0 for the meeting, and rank 0 keeps its store up
# this long after a failed one, so that every rank reports rank 0's list of missing ranks.
VERDICT_GRACE_S = 2.0
_LISTENERS: list[socket.socket] = []
VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


class RendezvousError(RuntimeError):
    """The ranks did not all meet; the message names the address and the missing ranks."""


@dataclass
class Meeting:
    """The store every rank is connected to, and what rank 0 shared through it."""

    store: SealedStore
    address: str
    host: str
    """Who serves the store ("rank 0", or the launcher), for messages."""
    shared: dict[str, str]
    nodes: tuple[str, ...]
    """Every rank's node (``nodes_of``)."""


def uses_gpu(device_key: str) -> bool:
    return device_key == "cuda" or (device_key == "auto" and torch.cuda.is_available())


def backend_for(device_key: str) -> str:
    """nccl on CUDA (RCCL on ROCm builds of PyTorch, same name), gloo on CPUs."""
    return "nccl" if uses_gpu(device_key) else "gloo"


def bind_device(device_key: str, local_rank: int, local_world: int) -> torch.device:
    """Make this rank's device the current one before anything allocates on a GPU.

    A launcher either shows every rank of a node all its GPUs (rank i takes GPU i) or binds
    each rank to its own (``srun --gpus-per-task=1``, or ``CUDA_VISIBLE_DEVICES`` /
    ``ROCR_VISIBLE_DEVICES`` set per rank: the rank takes the one GPU it sees).
    """
    if not uses_gpu(device_key):
        _share_cpu_cores(local_world)
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count >= local_world:
        index = local_rank
    elif count == 1:
        index = 0
    else:
        raise UserError(
            f"{local_world} ranks run on this node but each sees {count} GPUs ({_visible_devices()}); "
            "give every rank one GPU (srun --gpus-per-task=1) or let every rank see all of them."
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _share_cpu_cores(local_world: int) -> None:
    """Ranks sharing a node's CPU split its cores instead of each starting one thread per core."""
    if local_world > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // local_world))


def _visible_devices() -> str:
    shown = [f"{name}={os.environ[name]}" for name in VISIBLE_DEVICE_VARS if name in os.environ]
    return ", ".join(shown) or "no *_VISIBLE_DEVICES set"


def meet(info: RankInfo, timeout_s: float, shared: dict[str, str]) -> Meeting:
    """Connect to rank 0's store and wait until every rank has signed in.

    Rank 0 decides when the meeting has failed and tells everyone which ranks are missing; the
    others wait a little longer than it does, so that they hear its verdict rather than guess.
    ``shared`` is published by rank 0 and returned, as rank 0 set it, to every rank.
    """
    address = f"{info.master_addr}:{info.master_port}"
    deadline = time.monotonic() + timeout_s
    store = SealedStore(_open_store(info, address, timeout_s), secret.job_secret(address=address))
    if info.rank == 0:
        for key, value in shared.items():
            store.set(SHARED + key, value)
    store.set(f"{NODE}{info.rank}", json.dumps([info.node, info.node_index]))
    store.set(f"{ARRIVED}/{info.rank}", socket.gethostname())
    if info.rank == 0:
        _wait_for_all(store, info, address, deadline, timeout_s)
    else:
        _hear_from_rank_0(store, info, address, deadline + VERDICT_GRACE_S, timeout_s)
    values = {key: store.get(SHARED + key).decode() for key in shared}
    return Meeting(store, address, info.store_host, values, nodes_of(store))


def nodes_of(store) -> tuple[str, ...]:
    """Every rank's node, from what the ranks signed in with (``parallel.placement.node_names``);
    any rank may ask, once the meeting is over."""
    return node_names([(name, number) for name, number in json.loads(store.get(NODES))])


def _open_store(info: RankInfo, address: str, timeout_s: float) -> dist.TCPStore:
    timeout = timedelta(seconds=timeout_s)
    try:
        if info.rank == 0 and info.store_host == "rank 0":
            return dist.TCPStore(
                info.master_addr,
                info.master_port,
                info.world,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=_loopback_listener(info.master_addr, info.master_port),
            )
        return dist.TCPStore(info.master_addr, info.master_port, info.world, is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as err:
        if info.rank == 0 and info.store_host == "rank 0":
            raise RendezvousError(
                f"rank 0 cannot listen on {address} for the rendezvous ({_first_line(err)}); "
                "if the port is taken, choose another with launcher.master_port."
            ) from None
        raise RendezvousError(
            f"rendezvous at {address} failed after {timeout_s:g} s (launcher.rendezvous_timeout_s): "
            f"{info.store_host}, which hosts it, did not arrive; rank {info.rank} could not connect "
            f"({_first_line(err)})."
        ) from None


def _loopback_listener(host: str, port: int) -> Optional[int]:
    """A socket listening on ``host`` only, when ``host`` is a loopback address (a local run), for the store
    to serve on: TCPStore's own server listens on every interface, where other hosts could reach it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return None
    if not ipaddress.ip_address(address[0]).is_loopback:
        return None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(1024)
    _LISTENERS.append(listener)  # the store serves on its descriptor for the life of the process
    return listener.fileno()


def _wait_for_all(store: SealedStore, info: RankInfo, address: str, deadline: float, timeout_s: float) -> None:
    """Rank 0 waits for every rank's sign-in, then lets everyone go, or tells everyone who is missing."""
    signed_in = [f"{ARRIVED}/{r}" for r in range(info.world)]
    while not store.check(signed_in):
        if time.monotonic() > deadline:
            missing = [r for r in range(info.world) if not store.check([signed_in[r]])]
            forged = [r for r in missing if store.forged(signed_in[r])]
            message = (
                f"rendezvous at {address} timed out after {timeout_s:g} s (launcher.rendezvous_timeout_s): "
                f"{len(missing)} of {info.world} ranks did not arrive: {format_ranks(missing)}"
                + (
                    f"; {format_ranks(forged)} signed in without this job's secret ({secret.ENV}, or "
                    f"{secret.secret_file()} differing between nodes), and the run refuses them."
                    if forged
                    else "."
                )
            )
            store.set(ALL_ARRIVED, FAILED_PREFIX + message)
            time.sleep(VERDICT_GRACE_S)  # the store lives in this process: let the others read it
            raise RendezvousError(message)
        time.sleep(0.05)
    # One read of every rank's node, one key for everybody: no rank reads world keys.
    nodes = store.multi_get([f"{NODE}{r}" for r in range(info.world)])
    store.set(NODES, "[" + ",".join(node.decode() for node in nodes) + "]")
    store.set(ALL_ARRIVED, "1")


def _hear_from_rank_0(store, info: RankInfo, address: str, deadline: float, timeout_s: float) -> None:
    try:
        store.wait([ALL_ARRIVED], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        verdict = store.get(ALL_ARRIVED).decode()
    except RuntimeError:
        raise RendezvousError(
            f"rendezvous at {address} did not complete within {timeout_s:g} s (launcher.rendezvous_timeout_s): "
            f"{info.store_host}, which hosts it, stopped answering."
        ) from None
    if verdict.startswith(FAILED_PREFIX):
        raise RendezvousError(verdict[len(FAILED_PREFIX) :])


def _first_line(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def init_process_group(info: RankInfo, backend: str, meeting: Meeting, collective_timeout_s: float) -> None:
    """Start the default process group on the meeting's store; collectives fail after the timeout."""
    # The group's addresses go through the seal. A one-rank group exchanges none, and torch cannot put its
    # prefix over a Python store for it (ProcessGroupGloo asks the store for a clone that only C++ stores have).
    store = meeting.store if info.world > 1 else meeting.store.raw
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("torch/", store),
        rank=info.rank,
        world_size=info.world,
        timeout=timedelta(seconds=collective_timeout_s),
    )
