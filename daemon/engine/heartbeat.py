"""Progress inside a step: a prompt chunk of a large model can take minutes, and every decoder
layer it finishes (and every expert read it waits for) is progress, so the progress deadline
(transport/progress.py) measures the gap between layers, not between chunks. A wedged engine
stops beating and is still noticed within the deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

from moed.daemon.engine.status import EngineStatus
from moed.daemon.engine.step_abort import StepAborted
from moed.daemon.ground.faults import Faults

# Beats closer than this update the status once: a decode step of a streamed model beats per
# layer, and the deadline is measured in seconds.
PUBLISH_EVERY_S = 0.1


class StepHeartbeat:
    """Called on the engine thread from inside a forward pass; publishes `last_progress_at`."""

    def __init__(self, status: EngineStatus, faults: Faults) -> None:
        self.status = status
        self.faults = faults
        self.layers = 0  # decoder layers of prompt chunks finished since the start
        # True when the step should stop at this layer (every row in it was cancelled).
        self.abandon: Callable[[], bool] | None = None
        self._published = 0.0

    def beat(self) -> None:
        """An expert read landed or a streamed layer routed: the engine moves."""
        now = time.time()
        if now - self._published >= PUBLISH_EVERY_S:
            self._published = now
            self.status.update(last_progress_at=now)

    def layer_done(self) -> None:
        """A decoder layer of a prompt chunk was evaluated."""
        self.layers += 1
        self.beat()
        if self.faults:
            self.faults.in_layer(self.layers)
        if self.abandon is not None and self.abandon():
            raise StepAborted("every row of this prompt step was cancelled")
