"""Results of a pure function of frozen objects, looked up by the objects' identity.

The capacity model derives constants from the model, node and settings objects every step or
period; hashing pydantic models costs more than that work itself, while the same objects come
back each time. Each entry keeps its objects alive, so an id is never reused while it is cached,
and the objects are frozen, so the result stays theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

R = TypeVar("R")


class ByIdentity(Generic[R]):
    """``build(*objects)``, kept per identity of ``objects`` (at most ``size`` entries: the
    whole memo is dropped when full; a process holds a handful of each)."""

    def __init__(self, build: Callable[..., R], size: int = 256) -> None:
        self._build = build
        self._size = size
        self._hits: dict[tuple[int, ...], tuple[tuple[object, ...], R]] = {}

    def get(self, *objects: object) -> R:
        key = tuple(map(id, objects))
        hit = self._hits.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], objects, strict=True)):
            return hit[1]
        if len(self._hits) >= self._size:
            self._hits.clear()
        result = self._build(*objects)
        self._hits[key] = (objects, result)
        return result
