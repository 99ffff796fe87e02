"""What the engine hands the expert streamer, the one way in from outside experts/: its hooks once
a model is loaded (`EngineHooks`, ExpertStreamer.attach), and for a step the scopes it enters
around it (`StepScopes`, ExpertStreamer.steps: the step's output unused, a prompt-end step, a
request's route observer). Inside, the routing, loads and passes read the hooks and the observer
from one shared `Watchers` (tests/project/test_streamer_door.py: nothing outside experts/ assigns
a streamer's attribute)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from moed.daemon.ground.faults import SyncPoint

if TYPE_CHECKING:  # types only: the cache imports nothing of this
    from moed.daemon.experts.cache import LayerPool


class RouteObserver(Protocol):
    """Sees each host-routed layer call's choices and each admission of its experts (a request's
    router trace: telemetry/trace.py). Called on the engine thread, inside the step."""

    def on_route(self, layer: int, host: np.ndarray) -> None:
        """`host`: the router's choices, an array of the call's indices' shape."""

    def on_load(
        self, layer: int, pool: LayerPool, hits: list[int], loads: list[tuple[int, int]]
    ) -> None:
        """Before the reads: `hits` were resident, `loads` (expert, slot) are to be read."""


def no_progress() -> None:
    """The default progress hook: nobody watches (benches, tests in-process)."""


@dataclass(frozen=True)
class EngineHooks:
    """The engine's hooks, handed in once a model is loaded (ExpertStreamer.attach)."""

    # Called on the engine thread when a layer routed or its reads landed: progress inside a
    # step, for the engine's progress deadline (engine/heartbeat.py).
    progress: Callable[[], None] = no_progress
    # Called after each router read-back and fence evaluation (tests inject device failures).
    on_sync: Callable[[SyncPoint], None] | None = None


@dataclass(frozen=True)
class StepScopes:
    """What the engine hands in for a step: the scopes it enters around it (ExpertStreamer.steps),
    each on the engine thread."""

    # The step's output is dropped (a prompt chunk): the last layer sits it out (unused_output.py).
    unused_output: Callable[[], AbstractContextManager[None]]
    # The step reads prompts' last tokens: their experts read ahead and kept (prompt_end.py).
    prompt_end: Callable[[], AbstractContextManager[None]]
    # A request's route observer sees the step's routing and admissions (telemetry/trace.py).
    observing: Callable[[RouteObserver], AbstractContextManager[None]]


class Watchers:
    """Who watches the streamer's calls now: the engine's hooks (attached once) and a request's
    route observer (one step). Shared by the routing, the loads and the passes."""

    def __init__(self) -> None:
        self.observer: RouteObserver | None = None
        self.progress: Callable[[], None] = no_progress
        self.on_sync: Callable[[SyncPoint], None] | None = None

    @contextmanager
    def observing(self, observer: RouteObserver) -> Iterator[None]:
        """`observer` sees every routing and admission of the passes inside (one traced step)."""
        self.observer = observer
        try:
            yield
        finally:
            self.observer = None
