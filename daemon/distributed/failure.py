"""How a lost rank shows up on the others: MLX raises from the collective that lost its peer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# The ring backend says "[ring] connection to a peer was lost"; JACCL prefixes "[jaccl]".
_BACKEND_TAGS = ("[ring]", "[jaccl]")


def is_group_failure(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(tag in str(exc) for tag in _BACKEND_TAGS)


def outside_a_step(what: str, call: Callable[[], T], log: logging.Logger) -> T | None:
    """`call()`, a group operation between steps (a status, a sync, an SSD load); None, with a
    warning, when a rank went during it: the next step's collectives raise the same and fail the
    group as lost (rank_failed, retryable), where raising here would fail the engine (internal)."""
    try:
        return call()
    except RuntimeError as exc:
        if not is_group_failure(exc):
            raise
        log.warning("pipeline %s: %s", what, exc)
        return None
