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
touching ``torch.distributed``, so launchers can call it before spawning anything. The plan's
ranks on nodes are a ``Placement``, and one rank's share of it, with its process groups, a
``Layout`` (both in ``placement.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

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
