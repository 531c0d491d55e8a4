"""One registry per seam (layouts, transports, linear formats and backends, attention kernels): name -> implementation.

Config checks, error messages and docs read the names from here, so no allow-list is written twice: a
registry knows the config key that names its entries, and ``unknown`` is the one sentence a wrong name gets.
"""

from __future__ import annotations

from typing import Generic, Iterator, Optional, TypeVar

from ditrun.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """An ordered name -> implementation map that names its config key in its errors."""

    def __init__(self, what: str, key: Optional[str] = None):
        self.what = what
        """What an entry is, in words (``attention kernel``)."""
        self.key = key
        """The config key whose value names an entry (``precision.attention``)."""
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise KeyError(f"{self.what} {name!r} is registered twice")
        self._items[name] = item
        return item

    def names(self) -> list[str]:
        return list(self._items)

    def allowed(self) -> str:
        return ", ".join(self._items)

    def unknown(self, name: object, key: Optional[str] = None, extra: str = "") -> UserError:
        """The one sentence for a value of ``key`` (default: the registry's) that names no entry; ``extra``: other
        allowed values before the registry's names (``auto, emulation``)."""
        allowed = f"{extra}, {self.allowed()}" if extra else self.allowed()
        return UserError(f"{key or self.key}={name!r} is not a known {self.what}; allowed: {allowed}.")

    def get(self, name: str, key: Optional[str] = None) -> T:
        """The implementation named by config key ``key`` (default: the registry's); a UserError if unknown."""
        if name not in self._items:
            raise self.unknown(name, key)
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def items(self):
        return self._items.items()
