"""A flag the engine raises around some of its forward passes, for the streaming layers to read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class EngineScope:
    """Set by the engine, on its thread, for the passes inside `scope()`."""

    def __init__(self) -> None:
        self.active = False

    @contextmanager
    def scope(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False
