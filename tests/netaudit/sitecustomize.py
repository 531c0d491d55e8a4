"""Loaded by every Python process whose PYTHONPATH starts with this folder (tests/test_offline.py):
records each attempt to reach another machine (resolve a name, connect, send) as one JSON line
in $DITRUN_NET_AUDIT. Loopback and Unix-socket traffic (W&B's own service process, the
rendezvous of local ranks) is allowed and not recorded."""

import ipaddress
import json
import os
import socket
import sys

_LOG = os.environ.get("DITRUN_NET_AUDIT")
_EVENTS = (
    "socket.connect",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyname_ex",
    "socket.gethostbyaddr",
)


def _is_local(host) -> bool:
    if host in (None, "", "localhost", socket.gethostname()):
        return True
    try:
        address = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return False  # a name to resolve: somewhere else
    return address.is_loopback or address.is_unspecified


def _target(event: str, args):
    if event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
        sock, address = args[0], args[1] if len(args) > 1 else None
        if getattr(sock, "family", None) == socket.AF_UNIX or not isinstance(address, tuple):
            return None
        return address[0]
    return args[0] if args else None


def _audit(event: str, args) -> None:
    if event not in _EVENTS:
        return
    host = _target(event, args)
    if _is_local(host):
        return
    with open(_LOG, "a") as log:
        log.write(json.dumps({"pid": os.getpid(), "event": event, "host": str(host), "argv": sys.argv[:1]}) + "\n")


if _LOG:
    sys.addaudithook(_audit)
