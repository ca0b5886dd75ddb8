"""A small least-recently-used map: the bound on every per-shape cache (captured CUDA graphs, RoPE
tables, kernel counters), so a long-running service that sees a new crop size per request does not grow without
limit."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

V = TypeVar("V")


class LRUCache(Generic[V]):
    """At most `max_items` entries; `put` evicts the least recently used ones and returns them (the caller may
    release what they hold). `get` marks an entry as used. Not thread-safe (one pipeline per worker thread)."""

    def __init__(self, max_items: int):
        if max_items < 1:
            raise ValueError(f"LRUCache needs max_items >= 1, got {max_items}")
        self.max_items = max_items
        self._items: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: Hashable) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: V) -> list[tuple[Hashable, V]]:
        self._items[key] = value
        self._items.move_to_end(key)
        evicted = []
        while len(self._items) > self.max_items:
            evicted.append(self._items.popitem(last=False))
        return evicted

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self):
        return self._items.keys()

    def values(self):
        return self._items.values()

    def clear(self) -> None:
        self._items.clear()
