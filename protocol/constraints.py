"""The generate fields that shape what the model may write: `format` (structured output),
`tool_choice` and `parallel_tool_calls` (tool calls), and `chat_template_kwargs` (template switches
such as `enable_thinking`). Checked here, at the edge; the daemon compiles the grammar."""

from __future__ import annotations

import enum
from typing import Any, NoReturn

from .errors import ErrorCode, ProtocolError
from .messages import Message

MAX_TEMPLATE_KWARGS = 16
MAX_SCHEMA_DEPTH = 64  # a schema nested deeper is refused before any compiler sees it


class FormatType(str, enum.Enum):
    JSON = "json"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON that validates against `schema`


class ToolChoice(str, enum.Enum):
    AUTO = "auto"  # the model decides (nothing is enforced)
    NONE = "none"  # the template is told of no tools
    REQUIRED = "required"  # the answer is one or more tool calls (enforced by a grammar)


def _refuse(message: str) -> NoReturn:
    raise ProtocolError(ErrorCode.INVALID_REQUEST, f"generate: {message}")


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


def validate_format(fmt: Any) -> None:
    if not isinstance(fmt, dict):
        _refuse("'format' must be a map {type, schema}")
    try:
        kind = FormatType(fmt.get("type"))
    except ValueError:
        _refuse(f"'format.type' must be one of {', '.join(t.value for t in FormatType)}")
    schema = fmt.get("schema")
    if kind is FormatType.JSON_SCHEMA and not isinstance(schema, dict):
        _refuse("'format.schema' must be a map (a JSON schema) with type json_schema")
    if schema is not None and _depth(schema) > MAX_SCHEMA_DEPTH:
        _refuse(f"'format.schema' is nested deeper than {MAX_SCHEMA_DEPTH} levels")


def validate_tool_fields(msg: Message) -> None:
    choice = msg.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict):
            name = choice.get("name")
            if not isinstance(name, str) or not name:
                _refuse("'tool_choice' must be auto, none, required or a map {name}")
            names = [tool_name(t) for t in msg.get("tools") or ()]
            if name not in names:
                _refuse(f"'tool_choice' names {name!r:.80}, which is not in 'tools'")
        else:
            try:
                ToolChoice(choice)
            except ValueError:
                _refuse("'tool_choice' must be auto, none, required or a map {name}")
            if choice == ToolChoice.REQUIRED.value and not msg.get("tools"):
                _refuse("'tool_choice' required needs 'tools'")
    parallel = msg.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        _refuse("'parallel_tool_calls' must be true or false")
    if msg.get("format") is not None and choice is not None:
        forced = isinstance(choice, dict) or choice == ToolChoice.REQUIRED.value
        if forced:
            _refuse("'format' and a forced 'tool_choice' cannot both constrain one answer")


def tool_name(tool: Any) -> str | None:
    """The function a tool spec names ({function: {name}} or a flat {name})."""
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    fn = function if isinstance(function, dict) else tool
    return fn.get("name")


def validate_template_kwargs(kwargs: Any) -> None:
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS:
        _refuse(f"'chat_template_kwargs' must be a map of at most {MAX_TEMPLATE_KWARGS} entries")
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            _refuse("'chat_template_kwargs' keys must be identifiers")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            _refuse(f"'chat_template_kwargs.{key}' must be a bool, number, string or nil")


def validate_constraint_fields(msg: Message, limits: Any = None) -> None:
    """The cross-field check of a generate's constraint fields (types and names)."""
    if msg.get("format") is not None:
        validate_format(msg["format"])
    validate_tool_fields(msg)
    if msg.get("chat_template_kwargs") is not None:
        validate_template_kwargs(msg["chat_template_kwargs"])
