"""Parallel degrees of a run, validated once, and the process groups that realise them.

A run's ranks form a grid with three process-group axes, outermost first:

* ``replica`` — data parallel: each replica runs its own share of the edits;
* ``cfg`` — 2 under ``cfg_split`` (one half runs the conditional branch, the other the
  unconditional one), else 1;
* ``sp`` — the Ulysses sequence-parallel group that shares one forward pass.

``rank = (replica * cfg_degree + cfg) * sp_degree + sp``: the ranks of one SP group are
consecutive, so on a multi-GPU node the busiest exchange stays on the fastest links; once the
rendezvous knows each rank's node, ``placement.py`` refuses a group that would still span two.

``plan_layout`` checks a config against the world size and the model's head count without
touching ``torch.distributed``, so launchers can call it before spawning anything;
``build_layout`` then creates every process group once, and the resulting ``Layout`` is passed
explicitly to whatever needs it (nothing is kept in module globals).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ditrun.errors import UserError
from ditrun.registry import Registry

AXES = ("replica", "cfg", "sp")


@dataclass(frozen=True)
class LayoutKind:
    """One ``layout.name``: what its checks, memory estimate and velocity function (``parallel/cfg.py``)
    read, so that no code asks for a layout by name."""

    name: str
    doc: str
    one_worker: bool = False
    """One worker per replica, no exchanges (``single``)."""
    cfg_degree: int = 1
    """2 when the cfg axis splits the replica's workers in two SP groups, one per CFG branch."""
    batched_cfg: bool = False
    """Both CFG branches stacked in one batch-2 pass."""

    @property
    def needs_true_cfg(self) -> bool:
        """Half the workers would be idle without the unconditional branch."""
        return self.cfg_degree == 2


LAYOUTS: Registry[LayoutKind] = Registry("layout", "layout")
for _kind in (
    LayoutKind("single", "one process per replica: the conditional, then the unconditional branch", one_worker=True),
    LayoutKind("ulysses", "both branches one after the other, each sequence-parallel over the replica's workers"),
    LayoutKind("cfg_batch", "both branches stacked in one batch-2 sequence-parallel pass", batched_cfg=True),
    LayoutKind(
        "cfg_split", "half the workers run each branch at once (two SP groups), then swap predictions", cfg_degree=2
    ),
):
    LAYOUTS.register(_kind.name, _kind)


def layout_kind(name: str) -> LayoutKind:
    """The registered layout ``name``; one sentence naming the allowed ones if there is none."""
    return LAYOUTS.get(name)


@dataclass(frozen=True)
class LayoutPlan:
    """The degrees of each axis; ``world = replicas * cfg_degree * sp_degree``."""

    name: str
    replicas: int
    cfg_degree: int
    sp_degree: int
    head_groups: int

    @property
    def kind(self) -> LayoutKind:
        return LAYOUTS.get(self.name, "layout")

    @property
    def world(self) -> int:
        return self.replicas * self.workers

    @property
    def workers(self) -> int:
        """Workers per replica (W)."""
        return self.cfg_degree * self.sp_degree

    def sizes(self) -> dict[str, int]:
        return {"replica": self.replicas, "cfg": self.cfg_degree, "sp": self.sp_degree}

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis."""
        replica, rest = divmod(rank, self.workers)
        cfg, sp = divmod(rest, self.sp_degree)
        return {"replica": replica, "cfg": cfg, "sp": sp}

    def rank_at(self, coords: dict[str, int]) -> int:
        return (coords["replica"] * self.cfg_degree + coords["cfg"]) * self.sp_degree + coords["sp"]

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (ranks that differ only in their index on it), in a fixed order."""
        groups = []
        for rank in range(self.world):
            coords = self.coords(rank)
            if coords[axis] == 0:
                groups.append([self.rank_at({**coords, axis: i}) for i in range(self.sizes()[axis])])
        return groups


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_layout(layout_cfg, world: int, num_heads: int) -> LayoutPlan:
    """Validate ``layout.*`` against the world size and head count; each failure is one sentence."""
    name, replicas, head_groups = layout_cfg.name, layout_cfg.replicas, layout_cfg.head_groups
    kind = layout_kind(name)
    if world < 1:
        raise UserError(f"launcher.world={world} must be a positive integer.")
    if replicas < 1:
        raise UserError(f"layout.replicas={replicas} must be a positive integer.")
    if head_groups < 1:
        raise UserError(f"layout.head_groups={head_groups} must be a positive integer.")
    if world % replicas:
        raise UserError(
            f"launcher.world={world} is not a multiple of layout.replicas={replicas}; "
            f"allowed launcher.world: multiples of {replicas} (replicas x workers per replica)."
        )
    workers = world // replicas
    _check_workers(kind, world, replicas, workers, head_groups)
    sp_degree = workers // kind.cfg_degree
    _check_heads(name, world, replicas, kind.cfg_degree, sp_degree, head_groups, num_heads)
    return LayoutPlan(name, replicas, kind.cfg_degree, sp_degree, head_groups)


def _check_workers(kind: LayoutKind, world, replicas, workers, head_groups) -> None:
    name = kind.name
    if kind.one_worker and workers != 1:
        others = ", ".join(n for n, k in LAYOUTS.items() if not k.one_worker)
        raise UserError(
            f"layout={name} runs one worker per replica, so launcher.world={world} must equal "
            f"layout.replicas={replicas}; use layout={_or_list(others)} for more workers per replica."
        )
    if kind.one_worker and head_groups != 1:
        raise UserError(
            f"layout.head_groups={head_groups} overlaps exchanges that layout={name} does not have; "
            f"allowed with layout={name}: 1."
        )
    if workers % kind.cfg_degree:
        raise UserError(
            f"layout={name} needs an even number of workers per replica, but launcher.world={world} / "
            f"layout.replicas={replicas} = {workers}; allowed launcher.world: multiples of {2 * replicas}."
        )


def _or_list(names: str) -> str:
    """ "a, b, c" -> "a, b or c"."""
    head, _, last = names.rpartition(", ")
    return f"{head} or {last}" if head else last


def _check_heads(name, world, replicas, cfg_degree, sp_degree, head_groups, num_heads) -> None:
    if num_heads % sp_degree:
        allowed = ", ".join(str(replicas * cfg_degree * d) for d in divisors(num_heads))
        raise UserError(
            f"model.num_attention_heads={num_heads} is not divisible by the Ulysses degree {sp_degree} "
            f"(layout={name}, launcher.world={world}, layout.replicas={replicas}); allowed launcher.world: {allowed}."
        )
    heads_per_worker = num_heads // sp_degree
    if heads_per_worker % head_groups:
        allowed = ", ".join(str(d) for d in divisors(heads_per_worker))
        raise UserError(
            f"layout.head_groups={head_groups} must divide the {heads_per_worker} heads per worker "
            f"(model.num_attention_heads={num_heads} / Ulysses degree {sp_degree}); allowed: {allowed}."
        )


@dataclass
class Layout:
    """A plan bound to one rank, with that rank's process group along each axis.

    ``groups[axis]`` is None for an axis of size 1: nothing is exchanged along it.
    """

    plan: LayoutPlan
    rank: int
    groups: dict[str, Optional[object]] = field(default_factory=dict)
    control: Optional[object] = None
    """A gloo group over the whole world, for data rank 0 sends every rank (None in a one-process run)."""
    replica_control: Optional[object] = None
    """A gloo group over this replica's workers, for decisions they must take together (None for one worker)."""
    nodes: tuple[str, ...] = ()
    """The node of every global rank (``parallel/placement.py``); empty means all on this rank's node."""

    @property
    def coords(self) -> dict[str, int]:
        return self.plan.coords(self.rank)

    @property
    def replica(self) -> int:
        return self.coords["replica"]

    @property
    def writes_records(self) -> bool:
        """Exactly one rank per replica writes that replica's results."""
        coords = self.coords
        return coords["cfg"] == 0 and coords["sp"] == 0

    def edit_share(self, edits: Sequence) -> list:
        """This replica's edits: every ``replicas``-th one, so that all ranks agree without talking."""
        return list(edits[self.replica :: self.plan.replicas])

    def agree_max(self, value: int) -> int:
        """The largest ``value`` of this replica's workers (on the CPU: no device synchronisation)."""
        if self.replica_control is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.replica_control)
        return int(tensor.item())

    def sp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over this rank's SP group, in place (itself when the group is one rank). Under
        ``cfg_split`` each branch's group sums apart: its decisions are its own."""
        if self.groups.get("sp") is not None:
            dist.all_reduce(tensor, group=self.groups["sp"])
        return tensor


def build_layout(plan: LayoutPlan, collective_timeout: Optional[timedelta] = None, nodes: Sequence[str] = ()) -> Layout:
    """Create the process groups of ``plan`` once; every rank calls this with the same plan.

    ``collective_timeout`` bounds every collective of the axis groups (``launcher.collective_timeout_s``):
    new groups do not inherit the world group's timeout, and torch's default is 30 minutes.
    ``nodes`` is the node of every rank, as the rendezvous found them (empty: one node).
    """
    nodes = tuple(nodes)
    if plan.world == 1:
        return Layout(plan, rank=0, groups={axis: None for axis in AXES}, nodes=nodes)
    if not dist.is_initialized() or dist.get_world_size() != plan.world:
        raise RuntimeError(f"build_layout needs torch.distributed initialised with {plan.world} ranks.")
    rank = dist.get_rank()
    groups: dict[str, Optional[object]] = {}
    for axis in AXES:
        groups[axis] = None
        if plan.sizes()[axis] == 1:
            continue
        # new_group is collective over the world: every rank creates every group, in one order.
        for ranks in plan.axis_groups(axis):
            group = dist.new_group(ranks, timeout=collective_timeout)
            if rank in ranks:
                groups[axis] = group
    # Waits of unbounded length (the reference pass) are on the store instead (``launch/job.py``), which
    # names a rank whose heartbeat stopped; what runs on this group is short once every rank is there.
    control = dist.new_group(backend="gloo", timeout=collective_timeout)
    return Layout(plan, rank, groups, control, _replica_control(plan, rank, collective_timeout), nodes)


def _replica_control(plan: LayoutPlan, rank: int, timeout: Optional[timedelta]):
    """This replica's gloo group (every rank creates every replica's, in one order)."""
    mine = None
    if plan.workers == 1:
        return mine
    for replica in range(plan.replicas):
        ranks = list(range(replica * plan.workers, (replica + 1) * plan.workers))
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if rank in ranks:
            mine = group
    return mine
