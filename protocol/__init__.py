"""moed.protocol: the wire schema, codec, error codes and version. Imports no mlx."""

from .codec import MAX_FRAME_BYTES, decode, encode
from .errors import RETRYABLE, ErrorCode, ProtocolError
from .events import (
    TERMINAL_EVENTS,
    DoneEvent,
    EngineEvent,
    FailedEvent,
    LoadProgress,
    ProgressEvent,
    PromptProgress,
    TelemetryEvent,
    TokenEvent,
    TraceEvent,
    event_from_wire,
)
from .generate import GenerateRequest, NamedTool, ResponseFormat
from .messages import (
    CONTROL_TYPES,
    TERMINAL_TYPES,
    Channel,
    FinishReason,
    MessageType,
    ModelsAction,
    PrefixCacheAction,
    ShedLevel,
)
from .rules import Limits
from .validation import validate_generate, validate_request
from .version import PROTOCOL_MAJOR, PROTOCOL_MINOR

__all__ = [
    "CONTROL_TYPES",
    "TERMINAL_EVENTS",
    "TERMINAL_TYPES",
    "MAX_FRAME_BYTES",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "RETRYABLE",
    "Channel",
    "DoneEvent",
    "EngineEvent",
    "ErrorCode",
    "FailedEvent",
    "FinishReason",
    "GenerateRequest",
    "Limits",
    "LoadProgress",
    "MessageType",
    "ModelsAction",
    "NamedTool",
    "PrefixCacheAction",
    "ProgressEvent",
    "PromptProgress",
    "ProtocolError",
    "ResponseFormat",
    "ShedLevel",
    "TelemetryEvent",
    "TokenEvent",
    "TraceEvent",
    "decode",
    "encode",
    "event_from_wire",
    "validate_generate",
    "validate_request",
]
