"""What the transport reads of a pipeline group's failure: the group's monitor thread
(distributed/, which the transport may not import) hands it over, and the transport ends every
request in flight with it."""

from __future__ import annotations

from typing import Protocol


class GroupFailure(Protocol):
    """A rank died or stalled (distributed/launch.py's GroupFailure answers it)."""

    @property
    def reason(self) -> str: ...

    @property
    def exit_code(self) -> int: ...  # what rank 0 exits with
