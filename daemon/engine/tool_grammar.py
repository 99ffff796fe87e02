"""The grammar of a forced tool call (tool_choice required or a named function), in the model's
own tool-call format as the parser reads it back (tool_format.py): the JSON format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and Qwen3.6's XML format
(`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n
</tool_call>`). Another format cannot be enforced, so such a request is refused, never run
unconstrained; so is a parameters schema the format cannot hold (a 400 naming the keyword), and a
parameter no value satisfies (`false`, required), in every format."""

from __future__ import annotations

import json
import re
from typing import Any

from moed.daemon.engine.schema_prep import prepared
from moed.daemon.engine.tool_format import ANNOTATIONS, CallFormat, call_format, writes_raw
from moed.protocol import ErrorCode, ProtocolError

_COMPACT = {"whitespace_flexible": False}
# What the XML format holds at the top of a tool's parameters: named parameters, each a schema.
_XML_TOP = frozenset({"type", "properties", "required", "additionalProperties"})
_XML_TOP |= frozenset({"$defs", "definitions"}) | ANNOTATIONS
_XML_KEY = re.compile(r"[^\s<>]+")  # a parameter name as the format's parser reads it back
_PARAMS_DEF = "moed_parameters"  # where the whole parameters schema goes when a $ref needs it
_VALUES = frozenset({"const", "enum", "default", "examples"})  # JSON values, not schemas


def _refuse(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_SCHEMA, message)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, dict) else tool


def _params(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return _closed(prepared(params)) if isinstance(params, dict) and params else {"type": "object"}


def _closed(schema: Any) -> Any:
    """Objects admit only their declared properties unless the schema says otherwise (as
    OpenAI's strict function calling): a forced call cannot grow keys without end."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _VALUES else _closed(v)) for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _has_local_refs(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(map(_has_local_refs, schema))
    if not isinstance(schema, dict):
        return False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        return True
    return any(_has_local_refs(v) for k, v in schema.items() if k not in _VALUES)


def _rebased(schema: Any, base: str) -> Any:
    """Local `$ref`s (`#...`, relative to the parameters schema) pointed under `base`, where the
    grammar puts that schema."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _VALUES else _rebased(v, base)) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal has JSON's escapes


def _marker(tokenizer: Any, text: str) -> str:
    """A call marker in the grammar: by token id when it is one token (Qwen's `<tool_call>` is an
    added token, which llguidance matches as that token, never as its spelling), else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else _lark_string(text)


def _json_rule(schema: Any) -> str:
    options = {**(schema if isinstance(schema, dict) else {}), "x-guidance": _COMPACT}
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
            "a forced tool call is held to the model's own tool-call format by a grammar, and "
            f"this model's ({parser or 'none in its chat template'}) is not one moed can "
            "enforce: let the model choose whether to call a tool (auto)",
        )
    if not tools:
        raise ProtocolError(ErrorCode.INVALID_SCHEMA, "tool_choice names no tool in 'tools'")
    start = _marker(tokenizer, tokenizer.tool_call_start)
    end = _marker(tokenizer, tokenizer.tool_call_end)
    rules = [f"start: call{'+' if many else ''}"]
    fns = [_function(t) for t in tools]
    if fmt is CallFormat.JSON:
        rules.append(f"call: {start} body {end}")
        rules.append(f"body: {_json_rule(_json_calls(fns))}")
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


def _json_calls(fns: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON format's body: {name, arguments} of one of the tools. A tool whose parameters
    refer to themselves (`$ref: "#/..."`) keeps them under `$defs`, its refs pointed there."""
    defs: dict[str, Any] = {}
    variants = []
    for i, fn in enumerate(fns):
        params = _params(fn)
        _satisfiable(fn.get("name"), params)
        if _has_local_refs(params):
            key = f"{_PARAMS_DEF}_{i}"
            defs[key] = _rebased(params, f"#/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn.get("name")}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "$defs": defs} if defs else schema


def _xml_function(i: int, fn: dict[str, Any]) -> list[str]:
    """`NAME>\\n` then its parameters, the required ones always, in the schema's order."""
    name = fn.get("name")
    params = _params(fn)
    unheld = sorted(set(params) - _XML_TOP)
    if unheld:
        raise _refuse(
            f"tool {name!r}: the XML tool-call format writes its parameters one by one, so "
            f"{', '.join(repr(k) for k in unheld)} at the top of its parameters schema cannot be "
            "enforced (keep them inside a parameter's schema)"
        )
    props, required = _satisfiable(name, params)
    for key in required:
        if key not in props:  # the format writes declared parameters only
            raise _refuse(f"tool {name!r}: required parameter {key!r} is not in its properties")
    refs = _has_local_refs(params)
    items, rules = [], []
    for j, (key, schema) in enumerate(props.items()):
        if not _XML_KEY.fullmatch(key):
            raise _refuse(
                f"tool {name!r}: parameter {key!r} cannot be written in the XML tool-call format "
                "(a name without spaces or angle brackets)"
            )
        if schema is False:  # no value satisfies it: it can only be left out
            continue
        rule = f"fn{i}_p{j}"
        value = f"{rule}_v"
        open_tag = _lark_string(f"<parameter={key}>\n")
        rules.append(
            f"{rule}: {open_tag} {value} {_lark_string(chr(10) + '</parameter>' + chr(10))}"
        )
        if writes_raw(schema):
            rules.append(f"{value}: {_raw_string(schema)}")
        else:
            rules.append(f"{value}: {_json_rule(_standalone(schema, params) if refs else schema)}")
        items.append(rule if key in required else f"{rule}?")
    rules.insert(0, f"fn{i}: {_lark_string(f'{name}>' + chr(10))} {' '.join(items)}")
    return rules


def _satisfiable(name: Any, params: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(properties, required) of a tool's parameters; refused when a required parameter has no
    value (schema false, or not declared where undeclared keys are closed off), in any format."""
    properties = params.get("properties")
    props = properties if isinstance(properties, dict) else {}
    required = [k for k in params.get("required") or () if isinstance(k, str)]
    for key in required:
        if props.get(key, params.get("additionalProperties", True)) is False:
            raise _refuse(
                f"tool {name!r}: required parameter {key!r} has no value that satisfies it (its "
                "schema is false, or it is not among the properties)"
            )
    return props, required


def _standalone(schema: Any, params: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema compiled alone, with the parameters schema its `$ref`s point into."""
    base = f"#/$defs/{_PARAMS_DEF}"
    own = _rebased(schema, base) if isinstance(schema, dict) else {}
    defs = own.get("$defs")
    defs = defs if isinstance(defs, dict) else {}
    return {**own, "$defs": {**defs, _PARAMS_DEF: _rebased(params, base)}}


def _raw_string(schema: dict[str, Any]) -> str:
    """A string parameter as the XML format writes it: raw text on one line (the parser takes it
    up to the closing tag as it is), within the schema's enum or length bounds."""
    if isinstance(schema.get("enum"), list):
        return " | ".join(_lark_string(v) for v in schema["enum"])
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if hi is not None and lo > hi:
        raise _refuse(f"a string parameter with minLength {lo} over maxLength {hi}")
    if lo or hi is not None:
        return f"/[^<\\n]{{{lo},{'' if hi is None else hi}}}/"
    return "/[^<\\n]*/"
