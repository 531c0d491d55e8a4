"""Which node each rank runs on, the rule that keeps an SP group on one node, the placement
that rank 0 prints, and one rank's share of it with its process groups (``Layout``).

A rank's node is what it signed in with at the rendezvous (``launch/rendezvous.py``): the
launcher's name for it (Slurm's node name) or its host name, and the launcher's node number
where the launcher gives one (Slurm's node id, torchrun's agent rank, MPI's shared-memory
split). Two ranks share a node only when both agree: a host name that the launcher numbers
twice is two nodes (two torchrun agents, or two ``slurmd -N``, on one machine). This is the one
source of truth for "which node is rank r on": the layout carries it, and the ``copy_engine``
transport sends to peers on other nodes through the collective library because of it.

Why an SP group stays on one node: Ulysses exchanges every attention input and output of every
layer inside the SP group, twice per step, which only a node's GPU links carry at speed, and the
copy engine maps its peers' memory, which only works within a node. CFG pairs (``cfg_split``)
swap one prediction per step and replicas exchange nothing, so they may span nodes. The rule
is checked before any model is built, and ``layout.allow_cross_node_sp=true`` lifts it.
"""

from __future__ import annotations

import platform
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ditrun.errors import UserError
from ditrun.parallel.layout import AXES, LayoutPlan, divisors

CFG_BRANCHES = ("cond", "uncond")


def format_ranks(ranks: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"ranks 1-3, 7"``."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def node_names(hosts: Sequence[tuple[str, Optional[int]]]) -> tuple[str, ...]:
    """Each rank's node from what it signed in with, (name, launcher's node number or None).

    A name the launcher numbers more than once is as many nodes, called ``name/number``.
    """
    numbers = defaultdict(set)
    for name, number in hosts:
        numbers[name].add(number)
    return tuple(name if len(numbers[name]) == 1 else f"{name}/{number}" for name, number in hosts)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


@dataclass(frozen=True)
class Placement:
    """A layout plan and the node of each of its ranks."""

    plan: LayoutPlan
    nodes: tuple[str, ...]
    """The node of every global rank (``node_names``)."""

    def __post_init__(self):
        if len(self.nodes) != self.plan.world:
            raise ValueError(f"{len(self.nodes)} node names for a plan of {self.plan.world} ranks")

    @classmethod
    def on_one_node(cls, plan: LayoutPlan) -> Placement:
        """Every rank on this machine (a one-process run, ranks spawned here, a test)."""
        return cls(plan, (platform.node() or "localhost",) * plan.world)

    def ranks_by_node(self) -> dict[str, list[int]]:
        """node -> its ranks, nodes in the order of their first rank."""
        ranks: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            ranks.setdefault(node, []).append(rank)
        return ranks

    def sp_groups(self) -> list[list[int]]:
        """Every SP group, numbered by its place in the rank order (``rank // sp_degree``)."""
        sp = self.plan.sp_degree
        return [list(range(start, start + sp)) for start in range(0, self.plan.world, sp)]

    def split_sp_groups(self) -> list[int]:
        """The numbers of the SP groups whose ranks are on more than one node."""
        return [g for g, ranks in enumerate(self.sp_groups()) if len({self.nodes[r] for r in ranks}) > 1]

    def check(self, allow_cross_node_sp: bool, num_heads: int) -> None:
        """Refuse an SP group on several nodes, in one sentence saying what would fit."""
        split = self.split_sp_groups()
        if not split or allow_cross_node_sp:
            return
        ranks = self.sp_groups()[split[0]]
        on = defaultdict(list)
        for rank in ranks:
            on[self.nodes[rank]].append(rank)
        where = _and([f"{node} ({format_ranks(r)})" for node, r in on.items()])
        sp, replicas = self.fitting_sp_degree(num_heads)
        raise UserError(
            f"layout={self.plan.name} with SP degree {self.plan.sp_degree} would put SP group {split[0]} "
            f"({format_ranks(ranks)}) on nodes {where}; an SP group must stay on one node: use an SP degree of "
            f"at most {sp} (layout.replicas={replicas}; {self._node_sizes()}), or set layout.allow_cross_node_sp=true."
        )

    def fitting_sp_degree(self, num_heads: int) -> tuple[int, int]:
        """The largest valid SP degree whose groups each stay on one node, and the replicas it takes."""
        plan = self.plan
        per_cfg = plan.world // plan.cfg_degree
        for sp in sorted(divisors(per_cfg), reverse=True):
            valid = num_heads % sp == 0 and (num_heads // sp) % plan.head_groups == 0
            starts = range(0, plan.world, sp)
            if valid and all(len(set(self.nodes[s : s + sp])) == 1 for s in starts):
                return sp, per_cfg // sp
        raise AssertionError("an SP degree of 1 always fits")

    def _node_sizes(self) -> str:
        sizes = [len(r) for r in self.ranks_by_node().values()]
        if len(set(sizes)) == 1:
            return f"the nodes hold {sizes[0]} ranks each"
        return f"the nodes hold {_and([str(s) for s in sizes])} ranks"

    def describe(self) -> str:
        """One line per node: its ranks and the groups they belong to (printed once, by rank 0)."""
        lines = [
            f"{node}: {format_ranks(ranks)} ({self._groups_on(ranks)})" for node, ranks in self.ranks_by_node().items()
        ]
        split = self.split_sp_groups()
        note = f"; SP group(s) {', '.join(map(str, split))} span nodes" if split else ""
        return "placement: " + "\n           ".join(lines) + note

    def _groups_on(self, ranks: list[int]) -> str:
        """``replica 0: sp group 0 [cfg cond], sp group 1 [cfg uncond]; replica 1: ...`` for these ranks."""
        plan, groups = self.plan, self.sp_groups()
        by_replica: dict[int, list[str]] = {}
        for g in sorted({r // plan.sp_degree for r in ranks}):
            replica, cfg = divmod(g, plan.cfg_degree)
            label = f"sp group {g}"
            if plan.cfg_degree == 2:
                label += f" [cfg {CFG_BRANCHES[cfg]}]"
            here = [r for r in groups[g] if r in ranks]
            if len(here) < len(groups[g]):
                label += f" ({format_ranks(here)} of {groups[g][0]}-{groups[g][-1]})"
            by_replica.setdefault(replica, []).append(label)
        if plan.workers == 1:
            return ", ".join(f"replica {replica}" for replica in by_replica)
        return "; ".join(f"replica {replica}: {', '.join(labels)}" for replica, labels in by_replica.items())


@dataclass
class Layout:
    """A placement bound to one rank, with that rank's process group along each axis.

    ``groups[axis]`` is None for an axis of size 1: nothing is exchanged along it.
    """

    placement: Placement
    rank: int
    groups: dict[str, Optional[object]] = field(default_factory=dict)
    control: Optional[object] = None
    """A gloo group over the whole world, for data rank 0 sends every rank (None in a one-process run)."""
    replica_control: Optional[object] = None
    """A gloo group over this replica's workers, for decisions they must take together (None for one worker)."""

    @property
    def plan(self) -> LayoutPlan:
        return self.placement.plan

    @property
    def nodes(self) -> tuple[str, ...]:
        """The node of every global rank."""
        return self.placement.nodes

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


def build_layout(placement: Placement, collective_timeout: Optional[timedelta] = None) -> Layout:
    """Create the process groups of ``placement``'s plan once; every rank calls this with the same placement.

    ``collective_timeout`` bounds every collective of the axis groups (``launcher.collective_timeout_s``):
    new groups do not inherit the world group's timeout, and torch's default is 30 minutes.
    """
    plan = placement.plan
    if plan.world == 1:
        return Layout(placement, rank=0, groups={axis: None for axis in AXES})
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
    return Layout(placement, rank, groups, control, _replica_control(plan, rank, collective_timeout))


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
