"""What a loaded model carries of rank 0's pipeline group, as the rooms below distributed/ see it:
distributed/leader.py's PipelineLeader answers it, and model/ names its type without importing the
room above it. The engine asks it between steps, on its own thread."""

from __future__ import annotations

from typing import Any, Protocol


class PipelineGroup(Protocol):
    """Rank 0's leader of a pipeline group."""

    def status(self) -> list[dict[str, Any]]: ...  # every rank's status, rank 0 first

    @property
    def ops_pending(self) -> bool: ...  # cache ops recorded, not yet carried to the followers

    def sync(self) -> None: ...  # carry them now (an idle engine's)

    def shed(self, fraction: float) -> None: ...  # every follower shrinks its expert cache

    def shutdown(self) -> None: ...  # the other ranks leave their loops and exit
