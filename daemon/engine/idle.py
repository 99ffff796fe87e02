"""Keep-alive: when the engine has been idle for the keep-alive time, the model and its expert
cache are released (state `idle`); the next request loads them again. Like ollama's keep_alive,
a request may set how long the model stays loaded after it (a duration, 0: unload at once, -1:
never); the daemon's `keep_alive` setting applies to requests that do not say.
"""

from __future__ import annotations

import time

from moed.protocol.units import KeepAliveDuration


class KeepAlive:
    """When to unload. Called on the engine thread only; times are time.monotonic()."""

    def __init__(self, default_s: float | None):
        self.default_s = default_s  # None: never unload
        self.current_s = default_s  # the last admitted request's choice
        self.idle_since: float | None = None

    def admitted(self, keep_alive: KeepAliveDuration | None) -> None:
        """A request started: nothing unloads while it runs; its keep_alive applies after it."""
        self.idle_since = None
        # Decoded at the edge; a request without one falls back to the daemon's setting.
        self.current_s = self.default_s if keep_alive is None else keep_alive.seconds

    def became_idle(self, now: float | None = None) -> None:
        self.idle_since = time.monotonic() if now is None else now

    def due(self, now: float | None = None) -> bool:
        if self.idle_since is None or self.current_s is None:
            return False
        now = time.monotonic() if now is None else now
        return now - self.idle_since >= self.current_s

    @property
    def seconds(self) -> float:
        """The keep-alive in force, as the wire reports it: -1 for never."""
        return -1.0 if self.current_s is None else self.current_s
