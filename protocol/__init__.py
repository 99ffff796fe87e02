"""moed.protocol: the wire schema, codec, error codes and version. Imports no mlx."""

from .codec import MAX_FRAME_BYTES, decode, encode
from .errors import RETRYABLE, ErrorCode, ProtocolError
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
    "TERMINAL_TYPES",
    "MAX_FRAME_BYTES",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "RETRYABLE",
    "Channel",
    "ErrorCode",
    "FinishReason",
    "GenerateRequest",
    "Limits",
    "MessageType",
    "ModelsAction",
    "NamedTool",
    "PrefixCacheAction",
    "ProtocolError",
    "ResponseFormat",
    "ShedLevel",
    "decode",
    "encode",
    "validate_generate",
    "validate_request",
]
