"""The shape of a tool spec in a generate's `tools`: what the chat templates, the tool-call parsers
and the forced-call grammars read of it, checked once at the edge. A spec is OpenAI's
`{type: function, function: {name, description, parameters}}` or the flat `{name, ...}`;
`parameters` is a JSON Schema object whose `properties` are schemas and whose `required` names
them. Deeper schema keywords are the grammar's to judge (a forced call refuses what it cannot
hold); here only what would otherwise reach code that expects a map, a list or a name."""

from __future__ import annotations

import re
from typing import Any, NoReturn

from .errors import ErrorCode, ProtocolError

MAX_TOOL_NAME_CHARS = 256
# A name is written between the model's markers (`<function=NAME>`) and read back up to the next
# space or bracket: one it could not be read back as is refused.
_BAD_NAME = re.compile(r"[\s<>\"'\x00-\x1f\x7f]")


def _refuse(kind: str, where: str, message: str) -> NoReturn:
    raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{kind}: {where} {message}")


def validate_tool_specs(tools: list[Any], kind: str = "generate") -> None:
    """Each tool of a generate's (or count_tokens') `tools` list (already a list of maps)."""
    for i, tool in enumerate(tools):
        function = tool.get("function")
        where = f"tools[{i}]"
        if function is not None:
            if not isinstance(function, dict):
                _refuse(kind, f"{where}.function", "must be a map {name, description, parameters}")
            where += ".function"
        fn = function if isinstance(function, dict) else tool
        _check_name(kind, f"{where}.name", fn.get("name"))
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            _refuse(kind, f"{where}.description", "must be a string")
        parameters = fn.get("parameters")
        if parameters is not None:
            _check_parameters(kind, f"{where}.parameters", parameters)


def _check_name(kind: str, where: str, name: Any) -> None:
    if not isinstance(name, str) or not name:
        _refuse(kind, where, "must be a non-empty string")
    if len(name) > MAX_TOOL_NAME_CHARS or _BAD_NAME.search(name):
        _refuse(
            kind,
            where,
            f"must be at most {MAX_TOOL_NAME_CHARS} characters without spaces, quotes, angle "
            f"brackets or control characters: {name[:80]!r}",
        )


def _check_parameters(kind: str, where: str, parameters: Any) -> None:
    if not isinstance(parameters, dict):
        _refuse(kind, where, "must be a JSON Schema object (a map)")
    kind_of = parameters.get("type")
    if kind_of is not None and kind_of != "object":
        _refuse(
            kind,
            f"{where}.type",
            f"must be 'object' (the arguments are a map), not {kind_of!r:.40}",
        )
    properties = parameters.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            _refuse(kind, f"{where}.properties", "must be a map of parameter names to schemas")
        for key, schema in properties.items():
            if not isinstance(key, str) or not key:
                _refuse(kind, f"{where}.properties", "keys must be non-empty strings")
            if not isinstance(schema, dict | bool):
                _refuse(
                    kind, f"{where}.properties.{key[:80]}", "must be a schema (a map or a boolean)"
                )
    required = parameters.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(name, str) for name in required)
    ):
        _refuse(kind, f"{where}.required", "must be a list of parameter names (strings)")
