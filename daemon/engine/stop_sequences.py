"""Stop sequences over a streamed text: the text ends exactly before the first match, also when a
stop spans several tokens, and the stop itself is never sent.

Text that could still be the start of a stop is held back until the next delta decides.
"""

from __future__ import annotations


class StopSequences:
    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.matched: str | None = None
        self._held = ""

    def feed(self, text: str) -> str:
        """The part of `text` (after what was held back) that can be sent now."""
        if not self.stops:
            return text
        if self.matched is not None:
            return ""
        buffer = self._held + text
        hit = min(((buffer.find(s), -len(s), s) for s in self.stops if s in buffer), default=None)
        if hit is not None:
            at, _, stop = hit
            self.matched = stop
            self._held = ""
            return buffer[:at]
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """What was held back, at the end of the stream (no stop can match any more)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that begins some stop."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
