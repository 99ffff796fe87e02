"""The model's tool-call format, and how a parameter's value is written and read in Qwen3.6's XML
format (`<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>`).

One rule, shared by the forced-call grammar (tool_grammar.py) and the parser (tool_calls.py): a
plain string parameter (`type: string`, at most an enum of one-line strings and length bounds) is
raw text, as Qwen writes strings; every other value is JSON (a const, an enum of numbers, a string
with a pattern, a schema without `type`, `true`), so what the grammar writes as JSON is read back
as JSON. mlx-lm's own qwen3_coder parser reads a value by its schema's top-level `type` alone (no
`type`: a string; "null": None; a boolean schema: TypeError), which this replaces for the format.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("moed.engine")


class CallFormat(str, enum.Enum):
    JSON = "json_tools"
    QWEN_XML = "qwen3_coder"


def call_format(tokenizer: Any) -> CallFormat | None:
    """The format mlx-lm inferred from the chat template (its parser's module), if moed knows it."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    try:
        return CallFormat(module.rsplit(".", 1)[-1])
    except ValueError:
        return None


# What the raw-text rule holds of a string schema; annotations change nothing that is written.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly"}
    | {"$comment", "$id", "$schema", "$anchor"}
)
_RAW_KEYWORDS = frozenset({"type", "enum", "minLength", "maxLength"}) | ANNOTATIONS


def _one_line(text: Any) -> bool:
    return isinstance(text, str) and "<" not in text and "\n" not in text


def writes_raw(schema: Any) -> bool:
    """Whether the XML format writes this parameter's value as raw text (else as JSON)."""
    if not isinstance(schema, dict) or schema.get("type") != "string":
        return False
    if not _RAW_KEYWORDS.issuperset(schema):
        return False
    options = schema.get("enum")
    if options is not None and not (isinstance(options, list) and all(map(_one_line, options))):
        return False
    return all(
        isinstance(schema.get(k, 0), int) and not isinstance(schema.get(k, 0), bool)
        for k in ("minLength", "maxLength")
    )


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _fits_type(value: Any, schema: Any) -> bool:
    """Whether a JSON value is of a type the schema's top-level `type` allows (no `type`: any)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    if kinds is None:
        return True
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        allowed = _JSON_TYPES.get(kind, ()) if isinstance(kind, str) else ()
        if isinstance(value, bool) and bool not in allowed:
            continue
        if isinstance(value, allowed) or (
            kind == "integer" and isinstance(value, float) and value.is_integer()
        ):
            return True
    return False


def read_value(text: str, schema: Any) -> Any:
    """A parameter's value from its text between the tags: raw for a plain string; else JSON of
    a type the schema allows; else (a model writing freely, unconstrained) a Python-style
    literal of the schema's type, or the text as it is."""
    if writes_raw(schema):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        pass
    else:
        if _fits_type(value, schema):
            return value
    loose = _loose_literal(text.strip())
    return loose if loose is not None and _fits_type(loose, schema) else text


def _loose_literal(text: str) -> bool | int | float | None:
    """`True`, `False`, `1_000`, `+3`, `.5`: what a model writing unconstrained may give for a
    boolean or a number."""
    if text in ("True", "False"):
        return text == "True"
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    integral = number.is_integer() and not any(c in text for c in ".eE")
    return int(number) if integral else number


_FUNCTION = re.compile(r"<function=\s*([^\s<>]+)>?")
_PARAMETER = re.compile(r"<parameter=\s*([^\s<>]+)>?")
_CLOSE = "</parameter>"
_DECODER = json.JSONDecoder()


def parse_xml_call(text: str, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """One call in the XML format (the text between the call markers) as {name, arguments};
    ValueError when it names no function."""
    found = _FUNCTION.search(text)
    if found is None:
        raise ValueError("no <function=NAME> in the tool call")
    name = found.group(1)
    end = text.rfind("</function>")
    body = text[found.end() : end if end > found.end() else len(text)]
    properties = _properties(name, tools)
    arguments: dict[str, Any] = {}
    at = 0
    while (tag := _PARAMETER.search(body, at)) is not None:
        key = tag.group(1)
        start = tag.end() + (1 if body.startswith("\n", tag.end()) else 0)
        schema = properties.get(key, True)
        value, at = _json_value(body, start, schema)
        if at < 0:  # raw text (or JSON the model wrote loosely): up to the closing tag
            close = body.find(_CLOSE, start)
            if close < 0:
                break
            raw = body[start:close]
            value = read_value(raw[:-1] if raw.endswith("\n") else raw, schema)
            at = close + len(_CLOSE)
        arguments[key] = value
    return {"name": name, "arguments": arguments}


def _json_value(body: str, start: int, schema: Any) -> tuple[Any, int]:
    """A JSON-written value read as JSON up to its end, so that a string holding the closing tag
    stays whole; (value, where its closing tag ends), or (None, -1) when it is not one."""
    if writes_raw(schema):
        return None, -1
    try:
        value, end = _DECODER.raw_decode(body, start)
    except ValueError:
        return None, -1
    close = end + (1 if body.startswith("\n", end) else 0)
    if not body.startswith(_CLOSE, close) or not _fits_type(value, schema):
        return None, -1
    return value, close + len(_CLOSE)


def _properties(name: str, tools: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any]:
    """The parameter schemas of the tool `name` (checked at the edge; read defensively here)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        fn = function if isinstance(function, Mapping) else tool
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            return props if isinstance(props, Mapping) else {}
    return {}
