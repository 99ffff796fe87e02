"""Tools and schemas through the real gateway and daemon, in each API's words: malformed tool specs
are a 400 (never `internal`, never a dead daemon) on a model with Qwen3.6's XML tool format;
forced calls there return arguments that validate; an overlapping `oneOf` is refused and an
integer-valued count accepted in every structured-output field; a call cut by max_tokens is
reported as cut and never comes back as text; a forced call on a model without a tool format is
refused in Anthropic's own shape; Anthropic's blocks keep the order they were written in."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

from moed.gateway.anthropic_api import _content
from moed.gateway.context import Collected, PartKind
from tests.fixtures.gateway_harness import start_stack
from tests.fixtures.tokenizer import ChatStyle

pytestmark = pytest.mark.process

NO_THINKING = {"enable_thinking": False}


def _stack(tmp, model):
    return start_stack(tmp, model, "--resident")


@pytest.fixture(scope="module")
def xml_stack(tmp_path_factory, checkpoint_factory):
    model = checkpoint_factory("qwen3_moe", chat=ChatStyle.AGENT)
    daemon, gateway, name = _stack(tmp_path_factory.mktemp("xml-gw"), model)
    yield daemon, gateway, name
    gateway.stop()
    daemon.stop()


@pytest.fixture(scope="module")
def plain_stack(tmp_path_factory, tiny_model):
    """A model whose chat template has no tool-call format at all."""
    model = tmp_path_factory.mktemp("plain-model") / "m"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    daemon, gateway, name = _stack(tmp_path_factory.mktemp("plain-gw"), model)
    yield daemon, gateway, name
    gateway.stop()
    daemon.stop()


def _message(body: dict, shape: str) -> str:
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    if shape == "ollama":
        return body["error"]
    assert body["error"]["type"], body
    return body["error"]["message"]


def _served(url: str, name: str) -> None:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text


def _openai_tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


# (path, fields, the API's error shape, words the message holds)
MALFORMED_TOOLS = [
    ("/v1/chat/completions", {"tools": [_openai_tool(parameters="{}")]}, "openai", "parameters"),
    (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": "f"}]},
        "openai",
        "function",
    ),
    (
        "/v1/chat/completions",
        {"tools": [_openai_tool(parameters={"type": "object", "required": 5})]},
        "openai",
        "required",
    ),
    (
        "/v1/chat/completions",
        {"tools": [_openai_tool(parameters={"type": "object", "properties": "a"})]},
        "openai",
        "properties",
    ),
    ("/v1/chat/completions", {"tools": [_openai_tool(name="two words")]}, "openai", "name"),
    (
        "/v1/messages",
        {"tools": [{"name": "f", "input_schema": "{}"}], "max_tokens": 4},
        "anthropic",
        "input_schema",
    ),
    (
        "/v1/messages",
        {
            "tools": [{"name": "f", "input_schema": {"type": "object", "required": 5}}],
            "max_tokens": 4,
        },
        "anthropic",
        "required",
    ),
    (
        "/v1/responses",
        {"tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
        "openai",
        "parameters",
    ),
    (
        "/api/chat",
        {"tools": [_openai_tool(parameters="{}")], "stream": False},
        "ollama",
        "parameters",
    ),
    (
        "/api/chat",
        {"tools": [{"type": "function", "function": "f"}], "stream": False},
        "ollama",
        "function",
    ),
]


def test_malformed_tool_specs_are_400_in_each_apis_shape(xml_stack):
    daemon, gateway, name = xml_stack
    for path, fields, shape, words in MALFORMED_TOOLS:
        body = {"model": name, **fields}
        if path == "/v1/responses":
            body["input"] = "hi"
        else:
            body["messages"] = [{"role": "user", "content": "hi"}]
        for forced in (False, True):  # told to the template, and forced through the grammar
            if forced and path != "/v1/messages":
                body["tool_choice"] = "required"
            elif forced:
                body["tool_choice"] = {"type": "any"}
            reply = httpx.post(f"{gateway.url}{path}", json=body, timeout=120)
            assert reply.status_code == 400, (path, fields, reply.text)
            assert words in _message(reply.json(), shape), (path, reply.text)
    assert daemon.proc.poll() is None
    _served(gateway.url, name)


# Real-world-shaped tools (MCP servers): enum- and const-only parameters without a `type`.
MCP_TOOLS = {
    "list_issues": {
        "type": "object",
        "properties": {
            "state": {"enum": ["open", "closed", "all"]},
            "per_page": {"type": "number", "minimum": 1, "maximum": 100},
            "api": {"const": 3},
            "draft": {"const": False},
            "label": {"type": "string", "enum": ["null", "bug"]},
        },
        "required": ["state", "per_page", "api", "draft", "label"],
    },
    "lookup_zip": {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "any": True},
        "required": ["zip", "any"],
    },
}


@pytest.mark.parametrize("tool", list(MCP_TOOLS))
def test_forced_xml_calls_return_arguments_that_validate(xml_stack, tool):
    _, gateway, name = xml_stack
    tools = [
        {"type": "function", "function": {"name": t, "parameters": p}} for t, p in MCP_TOOLS.items()
    ]
    for seed in (None, 1, 2):
        sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {}
        reply = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={
                "model": name,
                "messages": [{"role": "user", "content": "call it"}],
                "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": tool}},
                "parallel_tool_calls": False,
                "chat_template_kwargs": NO_THINKING,
                "max_tokens": 400,
                **sampling,
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        if choice["finish_reason"] == "length":  # an unbounded `true` value ran long
            assert not choice["message"].get("content")
            continue
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == tool
        jsonschema.validate(json.loads(call["function"]["arguments"]), MCP_TOOLS[tool])


def test_an_unsatisfiable_parameter_is_refused(xml_stack):
    _, gateway, name = xml_stack
    tool = _openai_tool(
        parameters={"type": "object", "properties": {"a": False}, "required": ["a"]}
    )
    reply = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={
            "model": name,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [tool],
            "tool_choice": "required",
        },
        timeout=120,
    )
    assert reply.status_code == 400 and "'a'" in _message(reply.json(), "openai"), reply.text


OVERLAPPING = {"type": "string", "oneOf": [{"minLength": 2}, {"maxLength": 4}]}
COUNTED = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1.0, "maxItems": 2}


def _structured(path: str, name: str, schema: dict) -> dict:
    """A body asking for `schema` through the path's own structured-output field."""
    if path == "/v1/chat/completions":
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        return {
            "model": name,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": fmt,
            "max_tokens": 60,
        }
    if path == "/v1/responses":
        fmt = {"type": "json_schema", "name": "s", "schema": schema}
        return {"model": name, "input": "x", "text": {"format": fmt}, "max_output_tokens": 60}
    return {
        "model": name,
        "messages": [{"role": "user", "content": "x"}],
        "format": schema,
        "stream": False,
        "options": {"num_predict": 60},
    }


def _answer_text(path: str, body: dict) -> str:
    if path == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    if path == "/v1/responses":
        return next(i for i in body["output"] if i["type"] == "message")["content"][0]["text"]
    return body["message"]["content"]


@pytest.mark.parametrize(
    "path, shape",
    [("/v1/chat/completions", "openai"), ("/v1/responses", "openai"), ("/api/chat", "ollama")],
)
def test_one_of_is_never_weakened_and_integer_valued_counts_pass(xml_stack, path, shape):
    _, gateway, name = xml_stack
    refused = httpx.post(
        f"{gateway.url}{path}", json=_structured(path, name, OVERLAPPING), timeout=120
    )
    assert refused.status_code == 400, refused.text
    assert "oneOf" in _message(refused.json(), shape)
    body = _structured(path, name, COUNTED)
    off = {"/api/chat": ("think", False), "/v1/responses": ("reasoning", {"effort": "none"})}
    key, value = off.get(path, ("chat_template_kwargs", NO_THINKING))
    body[key] = value
    reply = httpx.post(f"{gateway.url}{path}", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(_answer_text(path, reply.json())), COUNTED)


WRITER = {
    "type": "function",
    "function": {
        "name": "write",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
}


def test_a_call_cut_by_max_tokens_is_reported_as_cut_never_as_text(xml_stack):
    _, gateway, name = xml_stack
    ask = [{"role": "user", "content": "write"}]
    openai = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={
            "model": name,
            "messages": ask,
            "tools": [WRITER],
            "tool_choice": "required",
            "chat_template_kwargs": NO_THINKING,
            "max_tokens": 6,
        },
        timeout=120,
    ).json()
    choice = openai["choices"][0]
    assert choice["finish_reason"] == "length", openai
    assert not choice["message"].get("content") and not choice["message"].get("tool_calls")
    anthropic = httpx.post(
        f"{gateway.url}/v1/messages",
        json={
            "model": name,
            "messages": ask,
            "max_tokens": 6,
            "thinking": {"type": "disabled"},
            "tools": [{"name": "write", "input_schema": WRITER["function"]["parameters"]}],
            "tool_choice": {"type": "any"},
        },
        timeout=120,
    ).json()
    assert anthropic["stop_reason"] == "max_tokens", anthropic
    assert all("<tool_call>" not in b.get("text", "") for b in anthropic["content"]), anthropic
    assert not [b for b in anthropic["content"] if b["type"] == "tool_use"]


def test_a_forced_call_without_a_tool_format_is_refused_in_anthropics_words(plain_stack):
    _, gateway, name = plain_stack
    reply = httpx.post(
        f"{gateway.url}/v1/messages",
        json={
            "model": name,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "tools": [{"name": "write", "input_schema": WRITER["function"]["parameters"]}],
            "tool_choice": {"type": "any"},
        },
        timeout=120,
    )
    assert reply.status_code == 400, reply.text
    message = _message(reply.json(), "anthropic")
    assert "tool-call format" in message and "auto" in message
    assert "required" not in message and "named function" not in message  # OpenAI's words


def test_anthropic_blocks_keep_the_order_they_were_written_in():
    """A text written after a call comes after its tool_use block (it was a text block first)."""
    call = {"id": "toolu_1", "name": "f", "arguments": {"a": 1}}
    parts = [(PartKind.REASONING, "hm"), (PartKind.TOOL_CALL, call), (PartKind.TEXT, "done")]
    result = Collected("done", [], [], [call], "hm", parts)
    assert [b["type"] for b in _content(result)] == ["thinking", "tool_use", "text"]
    only_call = Collected("", [], [], [call], "", [(PartKind.TOOL_CALL, call)])
    assert [b["type"] for b in _content(only_call)] == ["tool_use"]
    assert _content(Collected("", [], [], [], "", [])) == [{"type": "text", "text": ""}]
