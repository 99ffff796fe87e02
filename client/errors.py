"""What a client can see go wrong: a request failed, or the daemon is gone (or came back new)."""

from __future__ import annotations

from typing import Any

from moed.protocol import ErrorCode
from moed.protocol.events import FailedEvent


class ClientError(Exception):
    """Base of every error the client library raises."""


class RequestFailed(ClientError):
    """The daemon answered this request with a typed `error` message."""

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        retryable: bool = False,
        budget: dict[str, Any] | None = None,
    ):
        try:
            code = ErrorCode(code)
        except ValueError:
            pass  # a newer daemon's code: keep the string
        super().__init__(f"{getattr(code, 'value', code)}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable
        # A refused prompt or max_tokens: {prompt_tokens, max_tokens?, limit}.
        self.budget = budget

    @classmethod
    def from_event(cls, event: FailedEvent) -> RequestFailed:
        return cls(event.code, event.message, event.retryable, event.budget)

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> RequestFailed:
        """From the daemon's `error` message."""
        return cls.from_event(FailedEvent.from_wire(msg))


class DaemonUnavailable(ClientError):
    """Nobody answered on the socket in time (not running, crashed, or wedged)."""

    code = ErrorCode.DAEMON_UNAVAILABLE
    retryable = True


class DaemonNotRunning(DaemonUnavailable):
    """No daemon runs on the socket: none bound it, or the one that did exited, was killed or is
    a zombie. Known at once (a refused connect, a process that is gone), never after a wait."""


# One line that says how to get a daemon, for every place that reports none.
START_HINT = "start one with `moe run` (it starts one on the demo model) or `moed serve`"


class InsecureSocket(ClientError):
    """The socket's directory is not this user's private directory: nothing was sent."""


class DaemonRestarted(DaemonUnavailable):
    """The daemon answering now is not the one that took the request (its boot_id changed)."""

    def __init__(self, message: str, old_boot_id: str | None, new_boot_id: str | None):
        super().__init__(message)
        self.code = ErrorCode.DAEMON_RESTARTED
        self.old_boot_id = old_boot_id
        self.new_boot_id = new_boot_id
