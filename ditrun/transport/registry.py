"""The transport registry: name -> implementation. The config check, its error message and the
docs' list of transports all derive from ``TRANSPORTS`` (a ``ditrun.registry.Registry``), so no allow-list is
written twice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ditrun.errors import UserError
from ditrun.registry import Registry
from ditrun.timers import ExposedTransfer
from ditrun.transport.base import LocalTransport, Transport


def _collective(
    group,
    timer: ExposedTransfer,
    device: torch.device,
    transport_cfg,
    timeout_s: float,
    nodes: Sequence[str],
    chaos_s: float,
) -> Transport:
    from ditrun.transport.collective import CollectiveTransport

    return CollectiveTransport(group, timer, device)


def _copy_engine(
    group,
    timer: ExposedTransfer,
    device: torch.device,
    transport_cfg,
    timeout_s: float,
    nodes: Sequence[str],
    chaos_s: float,
) -> Transport:
    from ditrun.transport.copy_engine import CopyEngineTransport

    return CopyEngineTransport(
        group,
        timer,
        device,
        timeout_s=transport_cfg.timeout_s or timeout_s,
        chaos_s=chaos_s,
        node_size=transport_cfg.node_size,
        nodes=nodes,
    )


@dataclass(frozen=True)
class TransportEntry:
    make: Callable[..., Transport]
    summary: str
    """One line for the docs and ``--help``-style listings."""


TRANSPORTS: Registry[TransportEntry] = Registry("transport", "transport")
TRANSPORTS.register(
    "collective", TransportEntry(_collective, "all_to_all_single of the process group's library (NCCL, RCCL, gloo)")
)
TRANSPORTS.register(
    "copy_engine",
    TransportEntry(
        _copy_engine,
        "per-peer one-sided copies into mapped receive slots: copy engines (CUDA), SDMA (ROCm), shared "
        "memory and one thread per peer (CPU)",
    ),
)


def check_transport(transport_cfg) -> None:
    """``transport.*`` mistakes, as one sentence each, before anything is built."""
    TRANSPORTS.get(transport_cfg.name)
    if transport_cfg.timeout_s is not None and transport_cfg.timeout_s <= 0:
        raise UserError(
            f"transport.timeout_s={transport_cfg.timeout_s} must be positive, or unset to use "
            "launcher.collective_timeout_s."
        )
    if transport_cfg.node_size < 0:
        raise UserError(
            f"transport.node_size={transport_cfg.node_size} must be 0 (the placement's nodes) or a "
            "positive number of consecutive ranks per node."
        )


def make_transport(
    transport_cfg,
    group,
    timer: ExposedTransfer,
    device: torch.device,
    timeout_s: float,
    nodes: Sequence[str] = (),
    chaos_s: float = 0.0,
) -> Transport:
    """The transport ``transport.name`` over the process group ``group`` (None: an axis of one rank).

    ``timeout_s`` bounds every wait of a one-sided transport unless ``transport.timeout_s`` is set;
    ``nodes`` is every global rank's node (``Layout.nodes``; empty: one node); ``chaos_s``
    (``testing.chaos_s``) delays a CPU copy engine's copies at random, for the tests.
    """
    check_transport(transport_cfg)
    if group is None:
        return LocalTransport(device)
    return TRANSPORTS.get(transport_cfg.name).make(group, timer, device, transport_cfg, timeout_s, nodes, chaos_s)
