"""The generate fields that chat APIs need: `messages` (+ `tools`), `stop` and `logprobs`, and the
`count_tokens` request. Checked here, at the edge, like every other field."""

from __future__ import annotations

import enum
from typing import Any, NoReturn

from .errors import ErrorCode, ProtocolError
from .messages import Message
from .tool_specs import validate_tool_specs

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256  # a stop is matched against held-back text: keep the hold-back small
MAX_TOP_LOGPROBS = 20


class Role(str, enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


def _refuse(message: str) -> NoReturn:
    raise ProtocolError(ErrorCode.INVALID_REQUEST, message)


def prompt_sources(msg: Message) -> list[str]:
    """Which of the exclusive prompt fields a generate / count_tokens carries."""
    return [name for name in ("prompt", "prompt_ids", "messages") if msg.get(name) is not None]


def validate_messages(messages: Any, tools: Any, raw: Any, kind: str) -> None:
    if not isinstance(messages, list) or not messages:
        _refuse(f"{kind}: 'messages' must be a non-empty list")
    if raw:
        _refuse(f"{kind}: 'raw' skips the chat template, which 'messages' need")
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or not all(isinstance(k, str) for k in turn):
            _refuse(f"{kind}: messages[{i}] must be a map")
        try:
            Role(turn.get("role"))
        except ValueError:
            _refuse(f"{kind}: messages[{i}].role must be one of {', '.join(r.value for r in Role)}")
        if not isinstance(turn.get("content", ""), str):
            _refuse(f"{kind}: messages[{i}].content must be a string")
        calls = turn.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            _refuse(f"{kind}: messages[{i}].tool_calls must be a list of maps")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        _refuse(f"{kind}: 'tools' must be a list of maps")
    if tools:
        validate_tool_specs(tools, kind)


def validate_chat_fields(msg: Message, kind: str = "generate") -> None:
    """`messages`, `tools`, `stop` and `logprobs` of a generate (types were checked already)."""
    if msg.get("messages") is not None:
        validate_messages(msg["messages"], msg.get("tools"), msg.get("raw"), kind)
    elif msg.get("tools") is not None:
        _refuse(f"{kind}: 'tools' go with 'messages'")
    stop = msg.get("stop")
    if stop is not None:
        if len(stop) > MAX_STOP_SEQUENCES:
            _refuse(f"{kind}: at most {MAX_STOP_SEQUENCES} stop sequences")
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            _refuse(f"{kind}: 'stop' must be a list of strings of 1..{MAX_STOP_CHARS} characters")
    logprobs = msg.get("logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        _refuse(f"{kind}: 'logprobs' (top alternatives per token) must be in 0..{MAX_TOP_LOGPROBS}")
