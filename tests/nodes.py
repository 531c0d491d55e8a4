"""Emulated nodes on one machine, for tests of jobs that span nodes.

A command run "as node X" runs in a UTS namespace of its own whose host name is X
(``unshare --uts``: root, or unprivileged user namespaces), so the launchers and ditrun itself
see X as the host, exactly where a real node's name would come from (``socket.gethostname()``,
torchrun's ``host`` field, Open MPI's daemons). Everything else is shared, as it is between the
nodes of a cluster with a shared file system: the network (127.0.0.1 reaches every "node"), the
files (one results directory), and ``/dev/shm``. The emulated names do not resolve, so launched
ranks are given the rendezvous address (``MASTER_ADDR=127.0.0.1``) and gloo its interface
(``GLOO_SOCKET_IFNAME=lo``): ``NODE_ENV``.

``as_node`` prefixes a command; ``AGENT`` is an ssh stand-in for launchers that start remote
daemons through one (Open MPI's ``--mca plm_rsh_agent``); ``hostfile`` writes an MPI hostfile.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from tiers import missing

AGENT = Path(__file__).parent / "emulated_node_agent.sh"
NODE_ENV = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def as_node(name: str, command: Sequence[str]) -> list[str]:
    """``command`` run with ``name`` as its host name (and its children's)."""
    return ["unshare", "--uts", "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", name, *command]


@functools.lru_cache(maxsize=None)
def why_no_emulated_nodes() -> Optional[str]:
    """None where this machine can emulate nodes; else the reason, for the skip message."""
    try:
        probe = subprocess.run(as_node("ditrun-probe", ["hostname"]), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as err:
        return f"cannot run `unshare --uts` to emulate nodes ({err})"
    if probe.returncode != 0 or probe.stdout.strip() != "ditrun-probe":
        return (
            f"`unshare --uts` cannot give a process its own host name here (needs root or unprivileged "
            f"user namespaces): {probe.stderr.strip() or probe.stdout.strip()}"
        )
    return None


def need_emulated_nodes() -> None:
    reason = why_no_emulated_nodes()
    if reason:
        missing("emulated-node", reason)


def hostfile(folder: Path, slots: dict[str, int]) -> Path:
    """An MPI hostfile (Open MPI's syntax): one line per emulated node."""
    path = folder / "hostfile"
    path.write_text("".join(f"{name} slots={n}\n" for name, n in slots.items()))
    return path
