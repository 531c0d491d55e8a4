"""A store whose values only the job's ranks can write: every value carries a tag made with the job's secret.

TCPStore serves anyone who connects: on a shared node another user can list, read and set the keys of a
running job (post a stop request, fake a heartbeat, redirect the results directory). ``SealedStore`` wraps the
job's store connection; each value it writes is ``tag | nonce | value``, the tag an HMAC-SHA256 of the key,
nonce and value under the job's secret (``launch.secret``), and each value it reads is checked. A value
without a valid tag is treated as absent: ``check`` says the key is not there, ``get`` and ``wait`` go on waiting
for a genuine one, ``add`` and ``compare_set`` replace it. Each such key is named once in a warning. The
nonce makes every write distinct, so ``compare_set`` on the stored bytes is a sound compare-and-swap and a
stranger cannot replay an old value in place of a newer one undetected by the swap.

The process group's own keys go through it too (``init_process_group`` is given this store), so gloo's and
NCCL's addresses cannot be swapped either. What a stranger still can do is delete or overwrite keys (the
job then fails, naming the key, rather than doing what the stranger wrote): a TCPStore cannot refuse a
connection, so the store of a local run also listens on loopback only (``rendezvous``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

TAG_BYTES = 32
NONCE_BYTES = 8
POLL_S = 0.05


class StoreTimeout(RuntimeError):
    """No genuine value arrived for a key within the store's timeout (TCPStore raises the same kind)."""


class SealedStore(dist.Store):
    """``raw``'s keys, with every value tagged by ``secret``; see the module's docstring."""

    def __init__(self, raw, secret: bytes, warned: Optional[set] = None):
        super().__init__()
        self.raw, self._secret = raw, secret
        self._warned = set() if warned is None else warned

    def _seal(self, key: str, value) -> bytes:
        value = value.encode() if isinstance(value, str) else bytes(value)
        nonce = os.urandom(NONCE_BYTES)
        return self._tag(key, nonce, value) + nonce + value

    def _tag(self, key: str, nonce: bytes, value: bytes) -> bytes:
        message = key.encode() + b"\0" + nonce + value
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def _open(self, key: str, stored: bytes) -> Optional[bytes]:
        """The value of a genuine ``stored``; None (and one warning per key) for anything else."""
        stored = bytes(stored)
        body = TAG_BYTES + NONCE_BYTES
        tag, nonce, value = stored[:TAG_BYTES], stored[TAG_BYTES:body], stored[body:]
        if len(stored) >= body and hmac.compare_digest(tag, self._tag(key, nonce, value)):
            return value
        if key not in self._warned:
            self._warned.add(key)
            print(
                f"ditrun: warning: ignored the store key {key!r}: its value was not written with this job's "
                "secret (another process that reaches the store, or a rank with another DITRUN_JOB_SECRET)",
                file=sys.stderr,
                flush=True,
            )
        return None

    def forged(self, key: str) -> bool:
        """Whether ``key`` holds a value that was not written with this job's secret."""
        return bool(self.raw.check([key])) and self._open(key, self.raw.get(key)) is None

    # -- the Store interface --------------------------------------------------------------------------

    def set(self, key: str, value) -> None:
        self.raw.set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._genuine(key, self._deadline(None))

    def check(self, keys: list[str]) -> bool:
        if not self.raw.check(keys):
            return False
        return all(self._open(key, stored) is not None for key, stored in zip(keys, self.raw.multi_get(keys)))

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        deadline = self._deadline(timeout)
        if timeout is None:
            self.raw.wait(keys)
        else:
            self.raw.wait(keys, timeout)
        for key in keys:
            self._genuine(key, deadline)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        deadline = self._deadline(None)
        return [self._genuine(key, deadline) for key in keys]

    def add(self, key: str, amount: int) -> int:
        if amount == 0:
            value = self._open(key, self.raw.get(key)) if self.raw.check([key]) else None
            return int(value or 0)
        while True:
            stored = self._current(key)
            value = self._open(key, stored) if stored else None
            new = int(value or 0) + amount
            if self._swap(key, stored, new):
                return new

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired = desired.encode() if isinstance(desired, str) else bytes(desired)
        while True:
            stored = self._current(key)
            value = self._open(key, stored) if stored else None
            if (value or b"") != expected:
                return value if value is not None else expected
            if self._swap(key, stored, desired):
                return desired

    def delete_key(self, key: str) -> bool:
        return self.raw.delete_key(key)

    def num_keys(self) -> int:
        return self.raw.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.raw.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.raw.timeout

    def clone(self) -> "SealedStore":
        """A second connection to the same store, with the same secret (a blocking wait needs its own)."""
        return SealedStore(self.raw.clone(), self._secret, self._warned)

    # -- helpers --------------------------------------------------------------------------------------

    def _current(self, key: str) -> bytes:
        """The stored bytes of ``key``, or b"" when it has none."""
        return bytes(self.raw.get(key)) if self.raw.check([key]) else b""

    def _swap(self, key: str, stored: bytes, value) -> bool:
        """Replace exactly ``stored`` (b"": no value yet) by a sealed ``value``; False when another write came first."""
        sealed = self._seal(key, str(value) if isinstance(value, int) else value)
        return bytes(self.raw.compare_set(key, stored, sealed)) == sealed

    def _deadline(self, timeout: Optional[timedelta]) -> float:
        return time.monotonic() + (timeout or self.raw.timeout).total_seconds()

    def _genuine(self, key: str, deadline: float) -> bytes:
        """The genuine value of a key that exists, waiting while it holds a forged one."""
        while (value := self._open(key, self.raw.get(key))) is None:
            if time.monotonic() > deadline:
                raise StoreTimeout(f"no value written with this job's secret arrived for the store key {key!r}")
            time.sleep(POLL_S)
        return value
