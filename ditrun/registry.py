"""One registry per seam (linear formats, attention kernels, ...): name -> implementation.

Config checks, error messages and docs read the names from here, so no allow-list is written twice.
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from ditrun.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """An ordered name -> implementation map that names the config key in its errors."""

    def __init__(self, what: str):
        self.what = what
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

    def get(self, name: str, key: str) -> T:
        """The implementation named by config key ``key`` (e.g. ``precision.mlp``); a UserError if unknown."""
        if name not in self._items:
            raise UserError(f"{key}={name!r} is not a known {self.what}; allowed: {self.allowed()}.")
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def items(self):
        return self._items.items()
