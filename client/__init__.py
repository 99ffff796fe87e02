"""moed.client: the thin client library and the `moe` CLI. Imports no mlx."""

from moed.protocol.paths import default_socket_path

from .client import Client
from .errors import (
    ClientError,
    DaemonNotRunning,
    DaemonRestarted,
    DaemonUnavailable,
    InsecureSocket,
    RequestFailed,
)
from .events import DoneEvent, Event, ProgressEvent, TelemetryEvent, TokenEvent, TraceEvent

__all__ = [
    "Client",
    "ClientError",
    "DaemonNotRunning",
    "DaemonRestarted",
    "DaemonUnavailable",
    "DoneEvent",
    "Event",
    "InsecureSocket",
    "ProgressEvent",
    "RequestFailed",
    "TelemetryEvent",
    "TokenEvent",
    "TraceEvent",
    "default_socket_path",
]
