"""A prompt step given up inside its forward pass.

A lone prompt's chunk is as large as the memory plan allows, and on a large streamed model one
chunk can take minutes. A client that leaves (or cancels) mid-chunk should free the engine within
a layer, not at the chunk's end: when every row of the batch is cancelled, the step stops at the
next decoder layer it finishes. The batch it leaves half-written holds only those rows, so it is
dropped whole; nothing anyone waits for is lost.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class StepAborted(Exception):
    """Raised from a layer hook: every row of the running step was cancelled."""


class CancelBoard:
    """Requests cancelled by other threads (the transport), for the engine to see inside a step;
    the engine's own Cancel command, which always follows, takes the key off again."""

    def __init__(self) -> None:
        self._keys: set[Any] = set()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._keys)  # read without the lock: a stale answer only delays an abort

    def post(self, key: Any) -> None:
        with self._lock:
            self._keys.add(key)

    def discard(self, key: Any) -> None:
        with self._lock:
            self._keys.discard(key)

    def holds_all(self, keys: Iterable[Any]) -> bool:
        with self._lock:
            return all(key in self._keys for key in keys)
