"""The grammar of a forced tool call (tool_choice required or a named function), in the model's
own tool-call format as mlx-lm's parser for it reads it back: the JSON format (`<tool_call>{"name":
..., "arguments": {...}}</tool_call>`) and Qwen3.6's XML format (`<tool_call>\\n<function=NAME>\\n
<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`). Another format cannot be
enforced, so such a request is refused, never run unconstrained."""

from __future__ import annotations

import enum
import json
from typing import Any

from moed.protocol import ErrorCode, ProtocolError

_COMPACT = {"whitespace_flexible": False}


class CallFormat(str, enum.Enum):
    JSON = "json_tools"
    QWEN_XML = "qwen3_coder"


def call_format(tokenizer: Any) -> CallFormat | None:
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    try:
        return CallFormat(module.rsplit(".", 1)[-1])
    except ValueError:
        return None


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, dict) else tool


def _params(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return _closed(params) if isinstance(params, dict) and params else {"type": "object"}


def _closed(schema: Any) -> Any:
    """Objects admit only their declared properties unless the schema says otherwise (as
    OpenAI's strict function calling): a forced call cannot grow keys without end."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal has JSON's escapes


def _marker(tokenizer: Any, text: str) -> str:
    """A call marker in the grammar: by token id when it is one token (Qwen's `<tool_call>` is an
    added token, which llguidance matches as that token, never as its spelling), else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else _lark_string(text)


def _json_rule(schema: dict[str, Any]) -> str:
    options = {**schema, "x-guidance": _COMPACT}
    return "%json " + json.dumps(options)


def tool_call_grammar(tokenizer: Any, tools: list[dict[str, Any]], many: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call, or one or more with `many`, to one of
    `tools`, between the model's own markers."""
    from llguidance import LLMatcher

    fmt = call_format(tokenizer)
    if fmt is None or not getattr(tokenizer, "has_tool_calling", False):
        parser = getattr(getattr(tokenizer, "tool_parser", None), "__module__", None)
        raise ProtocolError(
            ErrorCode.INVALID_SCHEMA,
            "tool_choice required or a named function is enforced by a grammar of the model's "
            f"tool-call format, and this model's ({parser or 'none'}) has none: use auto",
        )
    if not tools:
        raise ProtocolError(ErrorCode.INVALID_SCHEMA, "tool_choice names no tool in 'tools'")
    start = _marker(tokenizer, tokenizer.tool_call_start)
    end = _marker(tokenizer, tokenizer.tool_call_end)
    rules = [f"start: call{'+' if many else ''}"]
    fns = [_function(t) for t in tools]
    if fmt is CallFormat.JSON:
        variants = [
            {
                "type": "object",
                "properties": {"name": {"const": fn.get("name")}, "arguments": _params(fn)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for fn in fns
        ]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        rules.append(f"call: {start} body {end}")
        rules.append(f"body: {_json_rule(schema)}")
    else:
        names = []
        for i, fn in enumerate(fns):
            names.append(f"fn{i}")
            rules.extend(_xml_function(i, fn))
        rules.append(
            f"call: {start} {_lark_string(chr(10) + '<function=')} ({' | '.join(names)}) "
            f"{_lark_string('</function>' + chr(10))} {end}"
        )
    return LLMatcher.grammar_from_lark("\n".join(rules))


def _xml_function(i: int, fn: dict[str, Any]) -> list[str]:
    """`NAME>\\n` then its parameters, the required ones always, in the schema's order."""
    params = _params(fn)
    properties = params.get("properties")
    props = properties if isinstance(properties, dict) else {}
    required = set(params.get("required") or ())
    items, rules = [], []
    for j, (key, schema) in enumerate(props.items()):
        rule = f"fn{i}_p{j}"
        value = f"{rule}_v"
        open_tag = _lark_string(f"<parameter={key}>\n")
        rules.append(
            f"{rule}: {open_tag} {value} {_lark_string(chr(10) + '</parameter>' + chr(10))}"
        )
        if isinstance(schema, dict) and schema.get("type") == "string":
            rules.append(f"{value}: {_raw_string(schema)}")
        else:
            rules.append(f"{value}: {_json_rule(schema if isinstance(schema, dict) else {})}")
        items.append(rule if key in required else f"{rule}?")
    name = _lark_string(f"{fn.get('name')}>\n")
    rules.insert(0, f"fn{i}: {name} {' '.join(items)}")
    return rules


def _raw_string(schema: dict[str, Any]) -> str:
    """A string parameter as the XML format writes it: raw text on one line (the parser takes it
    up to the closing tag as it is), within the schema's enum or length bounds."""
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return " | ".join(_lark_string(v) for v in schema["enum"])
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):
        count = f"{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}"
        return f"/[^<\\n]{count}/"
    return "/[^<\\n]*/"
