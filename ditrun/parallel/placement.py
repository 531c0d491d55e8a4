"""Which node each rank runs on, the rule that keeps an SP group on one node, and the placement
that rank 0 prints.

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

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from ditrun.errors import UserError
from ditrun.parallel.layout import LayoutPlan, divisors

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
