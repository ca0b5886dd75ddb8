"""A small least-recently-used map: the bound on every per-shape cache of the engine (captured CUDA graphs, RoPE
tables, kernel counters, cuDNN attention graphs, cuBLASLt plans, cuDNN conv plans), so a long-running service that sees
a new crop size per request does not grow without limit.

A captured CUDA graph replays the library calls it recorded with the objects those calls looked up in such caches
(a cuDNN graph's workspace, for one): `held_while` collects every object the caches hand out (`used`) while a graph is
recorded, and the graph's own cache entry keeps them, so evicting one from its library cache never frees memory a
graph still reads; they go when the graph's entry is evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Generic, Hashable, Iterator, TypeVar

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

    def items(self):
        return self._items.items()

    def clear(self) -> None:
        self._items.clear()


_collecting = threading.local()


def used(obj) -> None:
    """Tell an active `held_while` block (of this thread) that `obj`, handed out by a per-shape cache, is in use."""
    held = getattr(_collecting, "held", None)
    if held is not None and all(h is not obj for h in held):
        held.append(obj)


@contextmanager
def held_while() -> Iterator[list]:
    """The objects the per-shape caches hand out (`used`) inside the block, in a list the caller keeps as long as
    what it records (a captured CUDA graph) may use them."""
    outer = getattr(_collecting, "held", None)
    held: list = []
    _collecting.held = held
    try:
        yield held
    finally:
        _collecting.held = outer
        if outer is not None:
            for obj in held:
                used(obj)
