"""The closed set of error codes that cross the wire, and whether each is worth retrying."""

from __future__ import annotations

import enum
from typing import Any


class ErrorCode(str, enum.Enum):
    BAD_FRAME = "bad_frame"  # not msgpack, or not a map
    INVALID_REQUEST = "invalid_request"  # missing or wrong-typed field
    UNKNOWN_TYPE = "unknown_type"
    UNSUPPORTED_VERSION = "unsupported_version"
    FRAME_TOO_LARGE = "frame_too_large"
    PROMPT_TOO_LONG = "prompt_too_long"
    # With `strict_max_tokens`: max_tokens past the context left after the prompt, or past
    # limits.max_tokens (refused, not capped).
    CONTEXT_EXCEEDED = "context_exceeded"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    MODEL_NOT_FOUND = "model_not_found"
    # The named model's memory plan is over what the loaded models may hold together, even alone.
    MODEL_DOES_NOT_FIT = "model_does_not_fit"
    DUPLICATE_ID = "duplicate_id"
    UNKNOWN_REQUEST = "unknown_request"  # cancel of an id the daemon does not know
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"
    OUT_OF_MEMORY = "out_of_memory"
    DAEMON_RESTARTED = "daemon_restarted"  # raised client-side when boot_id changes
    RANK_FAILED = "rank_failed"  # a pipeline rank died or stalled; the group restarts
    DAEMON_UNAVAILABLE = "daemon_unavailable"  # client-side: no answer within the liveness timeout
    ENGINE_STALLED = "engine_stalled"  # the engine made no progress within the deadline
    SLOW_CONSUMER = "slow_consumer"  # the client did not read; its streams were cancelled
    POISON_REQUEST = "poison_request"  # this request was in flight at two crashes: not replayed
    NOT_PERMITTED = "not_permitted"  # a control verb that affects others, without the owner's token
    INVALID_SCHEMA = "invalid_schema"  # a format schema or forced tool call no grammar can hold
    # A schema or tool set over the daemon's grammar limits (its size, its compile time).
    SCHEMA_TOO_COMPLEX = "schema_too_complex"
    INTERNAL = "internal"


RETRYABLE = frozenset(
    {
        ErrorCode.OVERLOADED,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.OUT_OF_MEMORY,
        ErrorCode.DAEMON_RESTARTED,
        ErrorCode.RANK_FAILED,
        ErrorCode.DAEMON_UNAVAILABLE,
        ErrorCode.ENGINE_STALLED,
        ErrorCode.SLOW_CONSUMER,
    }
)


class ProtocolError(Exception):
    """A request the daemon refuses; carries the wire code so the transport can answer with it."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def wire_fields(self) -> dict[str, Any]:
        """What the `error` message carries besides code and message."""
        return {}


class BudgetExceeded(ProtocolError):
    """A prompt or max_tokens over the model's limits, with the numbers (the error's `budget`), so
    a gateway can answer in its API's own words without counting the prompt first."""

    def __init__(
        self, code: ErrorCode, message: str, prompt_tokens: int, max_tokens: int | None, limit: int
    ):
        super().__init__(code, message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit

    def wire_fields(self) -> dict[str, Any]:
        budget = {"prompt_tokens": self.prompt_tokens, "limit": self.limit}
        if self.max_tokens is not None:
            budget["max_tokens"] = self.max_tokens
        return {"budget": budget}
