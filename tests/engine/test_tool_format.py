"""Forced tool calls: what the grammar writes, the parser reads back with the types the schema
asks, in both tool-call formats (the JSON one and Qwen3.6's XML one). Random walks through each
forced-call grammar (tests/fixtures/grammar_walk.py) are read back by the daemon's own ToolCalls
and validated against the tool's schema, for real-world tool schemas (MCP servers' enum-, const-
and oneOf-only parameters) and the cases mlx-lm's XML parser typed wrong."""

from __future__ import annotations

import json

import jsonschema
import pytest

from moed.daemon.engine.tool_calls import ToolCalls
from moed.daemon.engine.tool_format import parse_xml_call, read_value, writes_raw
from moed.daemon.engine.tool_grammar import tool_call_grammar
from moed.protocol import ErrorCode, ProtocolError
from tests.fixtures.grammar_walk import styled_tokenizer, walk
from tests.fixtures.tokenizer import ChatStyle

WALKS = 6  # per schema and format


@pytest.fixture(scope="module", params=[ChatStyle.AGENT, ChatStyle.CHATML], ids=["xml", "json"])
def tokenizer(request, tmp_path_factory):
    tok = styled_tokenizer(tmp_path_factory.mktemp(request.param.value), request.param)
    assert tok.has_tool_calling
    return tok


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _obj(required: list[str] | None = None, **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties)}


# The issue's cases: the XML format read them back as strings (or None) where the grammar wrote
# JSON, or dropped the pattern.
TYPED_WRONG = {
    "const_number": _obj(a={"const": 2}),
    "enum_numbers": _obj(a={"enum": [1, 2, 3]}),
    "const_false": _obj(a={"const": False}),
    "allof_number": _obj(a={"allOf": [{}, {"type": "number", "minimum": -9, "maximum": 9}]}),
    "string_enum_null": _obj(a={"type": "string", "enum": ["null"]}),
    "string_pattern": _obj(a={"type": "string", "pattern": "^[0-9]{5}$"}),
    "schema_true": _obj(["b"], a=True, b={"type": "integer", "minimum": 0, "maximum": 5}),
}
# Shaped like MCP servers' tools (filesystem, GitHub, elicitation's titled enums, pydantic's
# Optional), unbounded as they are.
REAL_WORLD = {
    "edit_file": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "edits": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"oldText": {"type": "string"}, "newText": {"type": "string"}},
                    "required": ["oldText", "newText"],
                    "additionalProperties": False,
                },
            },
            "dryRun": {"type": "boolean", "default": False},
        },
        "required": ["path", "edits"],
        "additionalProperties": False,
    },
    "list_issues": _obj(
        ["owner", "repo"],
        owner={"type": "string"},
        repo={"type": "string"},
        state={"enum": ["open", "closed", "all"]},
        sort={"type": "string", "enum": ["created", "updated", "comments"]},
        direction={"enum": ["asc", "desc"], "description": "no type: an enum only"},
        per_page={"type": "number", "minimum": 1, "maximum": 100},
        api={"const": "v3"},
    ),
    "pick_color": _obj(
        color={
            "type": "string",
            "oneOf": [
                {"const": "#FF0000", "title": "Red"},
                {"const": "#00FF00", "title": "Green"},
            ],
        },
        level={"oneOf": [{"const": 1, "title": "low"}, {"const": 3, "title": "high"}]},
    ),
    "optional_fields": _obj(
        ["limit"],
        limit={"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "null"}]},
        cursor={"type": ["string", "null"], "maxLength": 8},
        since={"type": "string", "format": "date"},
        tags={
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1.0,
            "maxItems": 2,
        },
    ),
    "refs": {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}, "again": {"$ref": "#/properties/unit"}},
        "required": ["unit", "again"],
        "$defs": {"Unit": {"enum": ["cm", "in"]}},
    },
}


@pytest.mark.parametrize("name", [*TYPED_WRONG, *REAL_WORLD])
def test_forced_calls_read_back_valid_arguments(tokenizer, name):
    parameters = {**TYPED_WRONG, **REAL_WORLD}[name]
    tool = _tool(name, parameters)
    grammar = tool_call_grammar(tokenizer, [tool], many=False)
    ended = 0
    for seed in range(WALKS):
        ids = walk(tokenizer, grammar, seed)
        if ids is None:
            continue
        ended += 1
        text = tokenizer.decode(ids)
        calls = ToolCalls(tokenizer, [tool])
        rest, made = calls.feed(text)
        tail, more = calls.flush()
        assert rest + tail == "" and len(made + more) == 1, text
        call = (made + more)[0]
        assert call["name"] == name
        jsonschema.validate(call["arguments"], parameters)  # the types the schema asks
    assert ended >= WALKS // 2, "the walks did not end"


@pytest.mark.parametrize(
    "parameters, word",
    [
        (_obj(a=False), "'a'"),  # no value satisfies it
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'b'"),
    ],
)
def test_an_unsatisfiable_parameter_is_refused_in_every_format(tokenizer, parameters, word):
    with pytest.raises(ProtocolError) as refused:
        tool_call_grammar(tokenizer, [_tool("f", parameters)], many=False)
    assert refused.value.code is ErrorCode.INVALID_SCHEMA and word in refused.value.message


def test_the_xml_format_refuses_what_it_cannot_hold_at_the_top(tmp_path):
    tok = styled_tokenizer(tmp_path, ChatStyle.AGENT)
    parameters = {**_obj(a={"type": "integer"}), "anyOf": [{"required": ["a"]}]}
    with pytest.raises(ProtocolError) as refused:
        tool_call_grammar(tok, [_tool("f", parameters)], many=False)
    assert "'anyOf'" in refused.value.message
    with pytest.raises(ProtocolError) as refused:
        tool_call_grammar(tok, [_tool("f", _obj(**{"two words": {"type": "string"}}))], False)
    assert "'two words'" in refused.value.message


@pytest.mark.parametrize(
    "schema, text, value",
    [
        ({"const": 2}, "2", 2),
        ({"enum": [1, 2, 3]}, "2", 2),
        ({"const": False}, "false", False),
        ({"allOf": [{}, {"type": "number"}]}, "-1.0", -1.0),
        ({"type": "string", "enum": ["null"]}, "null", "null"),
        ({"type": "string"}, "null", "null"),
        ({"type": "string", "pattern": "^[0-9]{5}$"}, '"01234"', "01234"),  # as forced
        ({"type": "string", "pattern": "^[0-9]{5}$"}, "01234", "01234"),  # as written freely
        (True, '{"k": [1]}', {"k": [1]}),
        (True, "free text", "free text"),
        ({"type": "boolean"}, "True", True),  # a model writing freely, Python-style
        ({"type": "integer"}, "seven", "seven"),  # never a crash: the text as it is
        ({"type": ["string", "null"]}, "null", None),
    ],
)
def test_a_value_is_read_as_the_grammar_writes_it(schema, text, value):
    assert read_value(text, schema) == value and type(read_value(text, schema)) is type(value)


def test_a_json_string_holding_the_closing_tag_stays_whole():
    schema = {"type": "string", "pattern": "^.*$"}
    assert not writes_raw(schema)
    text = '\n<function=f>\n<parameter=a>\n"x</parameter>y"\n</parameter>\n</function>\n'
    tools = [_tool("f", _obj(a=schema))]
    assert parse_xml_call(text, tools) == {"name": "f", "arguments": {"a": "x</parameter>y"}}
    assert json.dumps(parse_xml_call(text, None)["arguments"]) == '{"a": "x</parameter>y"}'


def test_a_forced_call_ends_where_its_grammar_ended_it(tokenizer):
    """A JSON string inside a forced call may spell the end marker: the call still ends at the
    marker's own token (XML: one token), or right after its JSON object (the JSON format)."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    value = f"x{end}y"
    schema = {"type": "string", "pattern": "^x"}
    if tokenizer.tool_parser.__module__.endswith("qwen3_coder"):
        body = f"\n<function=f>\n<parameter=a>\n{json.dumps(value)}\n</parameter>\n</function>\n"
    else:
        body = json.dumps({"name": "f", "arguments": {"a": value}})
    (end_id, *more) = tokenizer.encode(end, add_special_tokens=False)
    calls = ToolCalls(tokenizer, [_tool("f", _obj(a=schema))], forced=True)
    shown, made = calls.feed(start + body, token=None)  # ordinary tokens spell the marker inside
    tail, more_calls = calls.feed(end, token=None if more else end_id)
    assert shown + tail == "" and made == []
    assert [(c["name"], c["arguments"]) for c in more_calls] == [("f", {"a": value})]
