"""How a lost rank shows up on the others: MLX raises from the collective that lost its peer."""

from __future__ import annotations

# The ring backend says "[ring] connection to a peer was lost"; JACCL prefixes "[jaccl]".
_BACKEND_TAGS = ("[ring]", "[jaccl]")


def is_group_failure(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(tag in str(exc) for tag in _BACKEND_TAGS)
