"""The transport's record of each admitted generation, from admission to its terminal message.

A stream the client cancelled gets no token after the cancel `result`, and its `done` says
`cancelled` with the tokens that really went out. A stream the transport failed itself (the engine
stalled, the client stopped reading) already has its terminal error: the engine's later events for
it are dropped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from moed.daemon.engine.request import RequestKey
from moed.protocol import DoneEvent, FinishReason, decode, encode, event_from_wire


@dataclass
class Stream:
    fingerprint: str
    tokens_sent: int = 0
    cancelled: bool = False  # the client's cancel was answered `cancelled: true`


class StreamTable:
    def __init__(self) -> None:
        self.open: dict[RequestKey, Stream] = {}
        self.failed: set[RequestKey] = set()  # ended by the transport; the engine may still emit
        self._per_client: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self.open)

    def __contains__(self, key: RequestKey) -> bool:
        return key in self.open

    def of_client(self, identity: bytes) -> int:
        return self._per_client[identity]

    def add(self, key: RequestKey, fingerprint: str) -> None:
        self.open[key] = Stream(fingerprint)
        self._per_client[key[0]] += 1

    def close(self, key: RequestKey) -> Stream | None:
        stream = self.open.pop(key, None)
        if stream is not None:
            self._per_client[key[0]] -= 1
            if self._per_client[key[0]] <= 0:
                del self._per_client[key[0]]
        return stream

    def fail(self, key: RequestKey) -> None:
        """The transport sent this stream's terminal error; drop what the engine still sends."""
        if self.close(key) is not None:
            self.failed.add(key)

    def keys_of(self, identity: bytes) -> list[RequestKey]:
        return [k for k in self.open if k[0] == identity]

    def fingerprints(self) -> list[str]:
        return [s.fingerprint for s in self.open.values()]

    def outgoing(
        self, key: RequestKey, frame: bytes, is_token: bool, terminal: bool
    ) -> bytes | None:
        """The frame to send for one engine event of `key`, or None to drop it."""
        if key in self.failed:
            if terminal:
                self.failed.discard(key)  # the engine is done with it too
            return None
        stream = self.open.get(key)
        if stream is None:
            return frame  # not a tracked generation (never happens for engine events)
        if terminal:
            self.close(key)
            return _as_cancelled(frame, stream) if stream.cancelled else frame
        if stream.cancelled and is_token:
            return None  # nothing after the cancel result but the terminal
        if is_token:
            stream.tokens_sent += 1
        return frame


def _as_cancelled(frame: bytes, stream: Stream) -> bytes:
    """The `done` of a cancelled stream counts only the tokens that went out, says `cancelled`."""
    msg = decode(frame)
    done = event_from_wire(msg)
    if not isinstance(done, DoneEvent):
        return frame  # an error (out of memory, shutting down) stays what it is
    usage = {**done.usage, "completion_tokens": stream.tokens_sent}
    cancelled = replace(done, finish_reason=FinishReason.CANCELLED, usage=usage)
    return encode(cancelled.to_wire(msg["id"]))
