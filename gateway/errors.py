"""Gateway errors as data: what went wrong (a closed set) and the HTTP status it maps to.

Each API module renders an ApiError in its own shape; the mapping from the daemon's typed errors
to HTTP statuses lives here, once.
"""

from __future__ import annotations

import enum

from moed.client import ClientError, DaemonNotRunning, DaemonUnavailable, RequestFailed
from moed.client.errors import START_HINT
from moed.protocol import ErrorCode


class ErrorKind(str, enum.Enum):
    INVALID_REQUEST = "invalid_request"
    AUTHENTICATION = "authentication"
    FORBIDDEN = "forbidden"  # a foreign Host or Origin, or another local user
    NOT_FOUND = "not_found"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    TIMEOUT = "timeout"  # the daemon did not answer within the gateway's deadline
    CLIENT_CLOSED = "client_closed"  # the client left before the answer; nobody reads it


STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.AUTHENTICATION: 401,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
    ErrorKind.TIMEOUT: 504,
    ErrorKind.CLIENT_CLOSED: 499,  # nginx's convention, for the metrics only
}

NO_DAEMON = "no_daemon"  # the error code of a 503 when no daemon runs on the socket

# Seconds a client should wait before retrying: a full queue drains fast, a restart takes longer.
RETRY_AFTER_S = {ErrorKind.OVERLOADED: 1, ErrorKind.UNAVAILABLE: 5, ErrorKind.TIMEOUT: 5}

_KIND_OF_CODE = {
    ErrorCode.BAD_FRAME: ErrorKind.INTERNAL,
    ErrorCode.INVALID_REQUEST: ErrorKind.INVALID_REQUEST,
    ErrorCode.UNKNOWN_TYPE: ErrorKind.INTERNAL,
    ErrorCode.UNSUPPORTED_VERSION: ErrorKind.INTERNAL,
    ErrorCode.FRAME_TOO_LARGE: ErrorKind.TOO_LARGE,
    ErrorCode.PROMPT_TOO_LONG: ErrorKind.INVALID_REQUEST,  # every API answers it 400
    ErrorCode.CONTEXT_EXCEEDED: ErrorKind.INVALID_REQUEST,
    ErrorCode.MAX_TOKENS_TOO_LARGE: ErrorKind.INVALID_REQUEST,
    ErrorCode.MODEL_NOT_FOUND: ErrorKind.NOT_FOUND,
    ErrorCode.MODEL_DOES_NOT_FIT: ErrorKind.INVALID_REQUEST,  # a smaller budget or context can
    ErrorCode.DUPLICATE_ID: ErrorKind.INTERNAL,
    ErrorCode.UNKNOWN_REQUEST: ErrorKind.INVALID_REQUEST,
    ErrorCode.OVERLOADED: ErrorKind.OVERLOADED,
    ErrorCode.SHUTTING_DOWN: ErrorKind.UNAVAILABLE,
    ErrorCode.OUT_OF_MEMORY: ErrorKind.UNAVAILABLE,
    ErrorCode.DAEMON_RESTARTED: ErrorKind.UNAVAILABLE,
    ErrorCode.INVALID_SCHEMA: ErrorKind.INVALID_REQUEST,
    ErrorCode.SCHEMA_TOO_COMPLEX: ErrorKind.INVALID_REQUEST,
    # A rank's death, a stalled engine, a cancelled slow reader: the daemon or its group restarts
    # or the stream can be asked again, so each is a 503 with Retry-After.
    ErrorCode.RANK_FAILED: ErrorKind.UNAVAILABLE,
    ErrorCode.DAEMON_UNAVAILABLE: ErrorKind.UNAVAILABLE,
    ErrorCode.ENGINE_STALLED: ErrorKind.UNAVAILABLE,
    ErrorCode.SLOW_CONSUMER: ErrorKind.UNAVAILABLE,
    # In flight at two crashes: the daemon refuses to run it again; retrying cannot help.
    ErrorCode.POISON_REQUEST: ErrorKind.INVALID_REQUEST,
    ErrorCode.NOT_PERMITTED: ErrorKind.FORBIDDEN,
    ErrorCode.INTERNAL: ErrorKind.INTERNAL,
}


class ApiError(Exception):
    """A request the gateway answers with an error, in the shape of the API that was called."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code or kind.value

    @property
    def status(self) -> int:
        return STATUS[self.kind]

    def headers(self) -> dict[str, str]:
        retry = RETRY_AFTER_S.get(self.kind)
        return {"Retry-After": str(retry)} if retry else {}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param)


def from_client_error(exc: ClientError) -> ApiError:
    """The daemon's typed error (or its absence) as an ApiError."""
    if isinstance(exc, RequestFailed):
        code = exc.code if isinstance(exc.code, ErrorCode) else None
        kind = ErrorKind.INTERNAL if code is None else _KIND_OF_CODE.get(code, ErrorKind.INTERNAL)
        return ApiError(kind, exc.message, code=getattr(exc.code, "value", str(exc.code)))
    if isinstance(exc, DaemonNotRunning):  # known at once: say how to get one
        return ApiError(ErrorKind.UNAVAILABLE, f"{exc}; {START_HINT}", code=NO_DAEMON)
    if isinstance(exc, DaemonUnavailable):
        return ApiError(ErrorKind.UNAVAILABLE, f"the moed daemon is unavailable: {exc}")
    return ApiError(ErrorKind.INTERNAL, str(exc))
