"""Who this process is in the job: rank, local rank, world size, nodes and the rendezvous address.

Every launcher publishes the same few facts under its own environment-variable names, so each
one is a row of data (``RankTable``), not code. They are read in a fixed order: launchers that
start one process per rank *inside* another launcher's allocation come first (torchrun and
``mpiexec`` inside an ``sbatch`` job both see ``SLURM_*`` variables that describe the job, not
the rank). Under an MPI launcher that publishes none of the known names, mpi4py is asked, and
only then is it imported, so machines without an MPI library run everything else.

Where the rendezvous is: torchrun names it (``MASTER_ADDR``/``MASTER_PORT``, which a user may
also export under any launcher); under Slurm and submitit it is the job's first host and a port
derived from the job id, the same on every rank without any exchange; under MPI rank 0 picks a
free port and broadcasts its host and port.

Which node a rank is on: the launcher's name for it where it has one (Slurm's
``SLURMD_NODENAME``), else the host name, together with the launcher's number for the node
(``SLURM_NODEID``, torchrun's ``GROUP_RANK``, MPI's shared-memory split whenever mpi4py is
asked anyway); ``ditrun.parallel.placement`` cross-checks the two.
"""

from __future__ import annotations

import os
import re
import socket
import zlib
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from ditrun.errors import UserError

# Ports derived from a job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's
# ephemeral range (32768+), so a derived port never collides with an outgoing connection.
PORT_BASE = 20000
PORT_SPAN = 10000

# Slurm's step ids for the batch script and the extern step: a process there is not a task.
_NOT_A_TASK_STEP = {"batch", "extern", "interactive", "4294967294", "4294967295", "4294967292"}


@dataclass(frozen=True)
class RankTable:
    """The environment-variable names under which one launcher publishes a process's place."""

    launcher: str
    rank: str
    local_rank: str
    world: str
    local_world: Optional[str] = None
    nodes: Optional[str] = None
    job_id: Optional[str] = None
    node_index: Optional[str] = None
    """The launcher's number for this process's node (cross-checks the host names, ``parallel/placement.py``)."""
    node_name: Optional[str] = None
    """The launcher's name for this process's node, where it differs from the host name (Slurm's node name)."""


TORCHRUN = RankTable(
    "torchrun",
    rank="RANK",
    local_rank="LOCAL_RANK",
    world="WORLD_SIZE",
    local_world="LOCAL_WORLD_SIZE",
    nodes="GROUP_WORLD_SIZE",
    job_id="TORCHELASTIC_RUN_ID",
    node_index="GROUP_RANK",
)
OPEN_MPI = RankTable(
    "Open MPI",
    rank="OMPI_COMM_WORLD_RANK",
    local_rank="OMPI_COMM_WORLD_LOCAL_RANK",
    world="OMPI_COMM_WORLD_SIZE",
    local_world="OMPI_COMM_WORLD_LOCAL_SIZE",
)
MPICH = RankTable(
    "MPICH (PMI)", rank="PMI_RANK", local_rank="MPI_LOCALRANKID", world="PMI_SIZE", local_world="MPI_LOCALNRANKS"
)
SUBMITIT_LOCAL = RankTable(
    "submitit (local)",
    rank="SUBMITIT_LOCAL_GLOBALID",
    local_rank="SUBMITIT_LOCAL_LOCALID",
    world="SUBMITIT_LOCAL_NTASKS",
    local_world="SUBMITIT_LOCAL_NTASKS",
    nodes="SUBMITIT_LOCAL_JOB_NUM_NODES",
    job_id="SUBMITIT_LOCAL_JOB_ID",
)
# The step's variables, not the job's: a step may run fewer tasks than the job allocated.
SLURM = RankTable(
    "Slurm (srun)",
    rank="SLURM_PROCID",
    local_rank="SLURM_LOCALID",
    world="SLURM_STEP_NUM_TASKS",
    nodes="SLURM_STEP_NUM_NODES",
    job_id="SLURM_JOB_ID",
    node_index="SLURM_NODEID",
    node_name="SLURMD_NODENAME",
)

RANK_TABLES = (TORCHRUN, OPEN_MPI, MPICH, SUBMITIT_LOCAL, SLURM)
MPI4PY = "MPI (mpi4py)"
MPI_LAUNCHERS = {OPEN_MPI.launcher, MPICH.launcher, MPI4PY}
LOCAL_SPAWN = "ditrun's spawner"
"""The launcher of ``launch/spawn.py``'s ranks, which it starts with torchrun's variables."""

# Any of these means an MPI launcher started this process (PMI, PMI-2, PMIx, Open MPI, Hydra).
MPI_MARKERS = (
    "PMI_FD",
    "PMI_PORT",
    "PMI_RANK",
    "PMIX_RANK",
    "PMIX_NAMESPACE",
    "OMPI_COMM_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "HYDI_CONTROL_FD",
)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job and where the ranks meet."""

    launcher: str
    rank: int
    local_rank: int
    world: int
    local_world: int
    nodes: int
    master_addr: Optional[str] = None
    """None until resolved: under MPI rank 0 broadcasts it."""
    master_port: Optional[int] = None
    store_host: str = "rank 0"
    """Who hosts the rendezvous store: rank 0, or the launcher itself (torchrun's agent)."""
    node_index: Optional[int] = None
    """The launcher's number for this rank's node (Slurm's node id, torchrun's agent rank, the lowest world
    rank of MPI's shared-memory split); None where the launcher gives none."""
    node_name: Optional[str] = None
    """The launcher's name for this rank's node; None means the host name."""

    @property
    def node(self) -> str:
        """The name this rank's node goes by in the placement and in messages."""
        return self.node_name or socket.gethostname()


def discover(environ: Mapping[str, str] = os.environ) -> Optional[RankInfo]:
    """The launcher's view of this process, or None when no launcher started it."""
    for table in RANK_TABLES:
        if table is SLURM and not in_slurm_step(environ):
            continue
        if all(environ.get(name) for name in (table.rank, table.local_rank, table.world)):
            return check_rank_info(_from_table(table, environ), table)
    if under_mpi(environ):
        check_mpi_leftovers(environ)
        return from_mpi4py()
    return None


def check_rank_info(info: RankInfo, table: RankTable) -> RankInfo:
    """Refuse, in one sentence and before any rendezvous, a launcher's facts that cannot all be true."""
    names = f"{table.rank}={info.rank}, {table.local_rank}={info.local_rank}, {table.world}={info.world}"
    if info.world < 1 or not 0 <= info.rank < info.world:
        raise UserError(f"{info.launcher} says {names}: a rank must be at least 0 and below the world size.")
    if not 1 <= info.local_world <= info.world or not 0 <= info.local_rank < info.local_world:
        raise UserError(
            f"{info.launcher} says {names} with {info.local_world} ranks on this node: a local rank must be at "
            "least 0 and below the node's ranks, which are at most the world size."
        )
    return info


def check_mpi_leftovers(environ: Mapping[str, str]) -> None:
    """An MPI launcher's variables with no launcher behind them (left in a shell from another job) would end in MPI's
    own abort; name them instead: a descriptor that is not open, an address where nobody listens."""
    for name in ("PMI_FD", "HYDI_CONTROL_FD"):
        if environ.get(name) and not _open_descriptor(environ[name]):
            _leftover(environ, name, "that descriptor is not open in this process")
    if environ.get("PMI_PORT") and not _answers(environ["PMI_PORT"]):
        _leftover(environ, "PMI_PORT", "nothing answers there")


def _open_descriptor(value: str) -> bool:
    try:
        os.fstat(int(value))
    except (ValueError, OSError):
        return False
    return True


def _answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except (ValueError, OSError):
        return False
    return True


def _leftover(environ: Mapping[str, str], name: str, why: str) -> None:
    found = sorted(var for var in environ if var.startswith(("PMI_", "PMIX_", "HYDI_", "MPI_LOCAL")))
    raise UserError(
        f"{name}={environ[name]} is set, as MPI's launcher sets it for its ranks, but {why}: it is left over from "
        f"another launch; unset {', '.join(found)}, or start ditrun under mpiexec."
    )


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """True in a task started by ``srun``; False in the batch script, whose SLURM_PROCID is 0 too."""
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    return step is not None and step not in _NOT_A_TASK_STEP


def under_mpi(environ: Mapping[str, str]) -> bool:
    return any(name in environ for name in MPI_MARKERS)


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} must be an integer.") from None


def _from_table(table: RankTable, environ: Mapping[str, str]) -> RankInfo:
    rank, local_rank, world = (_int(environ, n) for n in (table.rank, table.local_rank, table.world))
    if table is SLURM:
        local_world = slurm_local_world(environ)
    elif table.local_world and environ.get(table.local_world):
        local_world = _int(environ, table.local_world)
    else:
        local_world = world
    nodes = _int(environ, table.nodes) if table.nodes and environ.get(table.nodes) else max(1, world // local_world)
    # torchrun's agent already serves a store at MASTER_PORT; its ranks join it as clients.
    agent_store = table is TORCHRUN and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return RankInfo(
        table.launcher,
        rank,
        local_rank,
        world,
        local_world,
        nodes,
        _master_addr(table, environ),
        _master_port(table, environ),
        "torchrun's agent" if agent_store else "rank 0",
        _optional_int(environ, table.node_index),
        environ.get(table.node_name or "") or None,
    )


def _optional_int(environ: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    return _int(environ, name) if name and environ.get(name) else None


def slurm_local_world(environ: Mapping[str, str]) -> int:
    """Tasks of this step on this node, from e.g. ``SLURM_STEP_TASKS_PER_NODE=4(x2),3``."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return _int(environ, "SLURM_STEP_NUM_TASKS")
    per_node = expand_tasks_per_node(spec)
    node = int(environ.get("SLURM_NODEID", "0"))
    return per_node[node] if node < len(per_node) else per_node[-1]


def expand_tasks_per_node(spec: str) -> list[int]:
    """``"4(x2),3"`` -> ``[4, 4, 3]`` (Slurm's compressed tasks-per-node list)."""
    counts = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise UserError(f"cannot read Slurm's tasks-per-node list {spec!r}.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list, e.g. ``gpu[01-03,7]-ib,login1`` -> 4 names, in order.

    The same result as ``scontrol show hostnames``, without needing Slurm's commands on the node:
    ranges keep their zero padding, and several bracket groups in one name expand as a product.
    """
    hosts = []
    for item in _split_top_level(hostlist):
        hosts += _expand_item(item)
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    return [
        prefix + value + rest for value in _expand_range_list(match.group(1), item) for rest in _expand_item(suffix)
    ]


def _expand_range_list(ranges: str, item: str) -> list[str]:
    values = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise UserError(f"cannot read Slurm host list entry {item!r}.")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return values


def _master_addr(table: RankTable, environ: Mapping[str, str]) -> Optional[str]:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if table is SLURM:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_hostlist(nodelist)
        return hosts[0] if hosts else None
    if table is SUBMITIT_LOCAL:
        return "127.0.0.1"
    return None


def _master_port(table: RankTable, environ: Mapping[str, str]) -> Optional[int]:
    if environ.get("MASTER_PORT"):
        return _int(environ, "MASTER_PORT")
    if table is SLURM:
        return port_from_job_id(environ["SLURM_JOB_ID"], environ.get("SLURM_STEP_ID", "0"))
    if table.job_id and environ.get(table.job_id):
        return port_from_job_id(environ[table.job_id])
    return None


def port_from_job_id(job_id: str, step: str = "0") -> int:
    """A port every rank of one job step computes alike; consecutive jobs get different ports."""
    if job_id.isdigit() and step.isdigit():
        key = int(job_id) * 16 + int(step)
    else:
        key = zlib.crc32(f"{job_id}.{step}".encode())
    return PORT_BASE + key % PORT_SPAN


def from_mpi4py() -> RankInfo:
    """Ask MPI itself, for MPI launchers whose variables none of the tables knows."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    nodes = world.allreduce(1 if node.Get_rank() == 0 else 0)
    return RankInfo(
        MPI4PY,
        world.Get_rank(),
        node.Get_rank(),
        world.Get_size(),
        node.Get_size(),
        nodes,
        node_index=node.bcast(world.Get_rank(), root=0),
    )


def with_address(info: RankInfo, port_override: Optional[int]) -> RankInfo:
    """Fill in the rendezvous address; under MPI, rank 0's host and a free port of its own."""
    if port_override is not None:
        info = replace(info, master_port=port_override)
    if info.master_addr is not None and info.master_port is not None:
        return info
    if info.launcher in MPI_LAUNCHERS:
        return _broadcast_address(info)
    raise UserError(f"{info.launcher} does not say where rank 0 listens: export MASTER_ADDR and MASTER_PORT.")


def _broadcast_address(info: RankInfo) -> RankInfo:
    from mpi4py import MPI

    proposal = None
    if info.rank == 0:
        proposal = (info.master_addr or socket.gethostname(), info.master_port or free_port())
    addr, port = MPI.COMM_WORLD.bcast(proposal, root=0)
    return replace(info, master_addr=addr, master_port=port, node_index=_mpi_node_index(info))


def _mpi_node_index(info: RankInfo) -> int:
    """The lowest world rank that shares memory with this one: MPI's own view of the node, which
    the placement cross-checks with the host names. MPI is initialised here already."""
    if info.node_index is not None:
        return info.node_index
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return world.Split_type(MPI.COMM_TYPE_SHARED).bcast(world.Get_rank(), root=0)


def free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
