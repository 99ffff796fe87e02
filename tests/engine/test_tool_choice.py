"""Forced tool calls by constrained decoding: tool_choice required and a named function hold the
answer to the model's own tool-call format (mlx-lm's JSON one and Qwen3.6's XML one) around the
tool's parameter schema, parallel_tool_calls false allows one call, and the HTTP APIs map their
controls (OpenAI tool_choice and streamed tool_calls deltas, Anthropic tool_use blocks)."""

from __future__ import annotations

import json

import httpx
import pytest

from moed.client import DoneEvent, RequestFailed, TokenEvent
from moed.protocol import ErrorCode
from tests.fixtures.tokenizer import ChatStyle

pytestmark = pytest.mark.process

# Bounded parameters, so that a forced call always ends within MAX_TOKENS.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
MAX_TOKENS = 120
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def calls_of(daemon, **request) -> tuple[list[dict], str, str]:
    """(tool calls, answer text, finish reason) of one generation."""
    calls, text, finish = [], [], None
    with daemon.client() as c:
        for event in c.generate(messages=ASK, max_tokens=MAX_TOKENS, **request):
            if isinstance(event, TokenEvent):
                calls += event.tool_calls or ()
                text.append(event.text if event.channel == "answer" else "")
            elif isinstance(event, DoneEvent):
                finish = event.finish_reason
    return calls, "".join(text), finish


def weather_ok(call: dict) -> bool:
    args = call["arguments"]
    return (
        call["name"] == "get_weather"
        and isinstance(args.get("city"), str)
        and isinstance(args.get("days"), int)
        and 1 <= args["days"] <= 9
    )


@pytest.fixture(scope="module")
def json_daemon(tmp_path_factory, tiny_model):
    from tests.fixtures.daemon_harness import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("tc-json"), tiny_model, "--resident")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def xml_daemon(tmp_path_factory, checkpoint_factory):
    from tests.fixtures.daemon_harness import start_daemon

    model = checkpoint_factory("qwen3_moe", chat=ChatStyle.AGENT)
    d = start_daemon(tmp_path_factory.mktemp("tc-xml"), model, "--resident")
    yield d
    d.stop()


@pytest.mark.parametrize("seed", [None, 5])
def test_required_is_one_call_in_the_json_format(json_daemon, seed):
    sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {}
    calls, text, finish = calls_of(
        json_daemon,
        tools=[WEATHER, TIME],
        tool_choice={"name": "get_weather"},
        parallel_tool_calls=False,
        **sampling,
    )
    assert len(calls) == 1 and weather_ok(calls[0]), calls
    assert text == "" and finish == "stop"


def test_required_allows_any_tool_and_several_calls(json_daemon):
    calls, text, finish = calls_of(json_daemon, tools=[WEATHER, TIME], tool_choice="required")
    assert calls
    # Only calls: a last call that max_tokens cut short is dropped, never given back as text.
    assert text == "" and finish in ("stop", "length")
    for call in calls:
        assert weather_ok(call) or (
            call["name"] == "get_time" and call["arguments"]["zone"] in ("utc", "cet")
        ), call


@pytest.mark.parametrize("seed", [None, 9])
def test_named_call_in_qwen_xml_format(xml_daemon, seed):
    sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {}
    calls, text, finish = calls_of(
        xml_daemon,
        tools=[TIME, WEATHER],
        tool_choice={"name": "get_weather"},
        parallel_tool_calls=False,
        chat_template_kwargs={"enable_thinking": False},
        **sampling,
    )
    assert len(calls) == 1 and weather_ok(calls[0]), calls
    assert text == "" and finish == "stop"


def test_a_choice_outside_the_tools_is_refused(json_daemon):
    with json_daemon.client() as c, pytest.raises(RequestFailed) as refused:
        list(c.generate(messages=ASK, tools=[TIME], tool_choice={"name": "get_weather"}))
    assert refused.value.code == ErrorCode.INVALID_REQUEST
    with json_daemon.client() as c, pytest.raises(RequestFailed) as refused:
        list(c.generate(messages=ASK, tool_choice="required"))
    assert refused.value.code == ErrorCode.INVALID_REQUEST


# ---- through the gateway ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(gateway_stack):
    daemon, gateway = gateway_stack
    with daemon.client() as c:
        return gateway, c.welcome["model"]["name"]


def _sse(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in response.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_openai_tool_choice_streams_tool_call_deltas(stack):
    gateway, model = stack
    body = {
        "model": model,
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    url = f"{gateway.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        chunks = [c for c in _sse(r) if c.get("choices")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [call for d in deltas for call in d.get("tool_calls") or ()]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["type"] == "function"
    args = json.loads(calls[0]["function"]["arguments"])
    assert weather_ok({"name": calls[0]["function"]["name"], "arguments": args})
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = httpx.post(url, json={**body, "stream": False}, timeout=60).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == args


def test_anthropic_tool_choice_any_is_a_tool_use_block(stack):
    gateway, model = stack
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in (WEATHER, TIME)
    ]
    body = {
        "model": model,
        "messages": ASK,
        "tools": tools,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    with httpx.stream("POST", f"{gateway.url}/v1/messages", json=body, timeout=60) as r:
        events = _sse(r)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    uses = [b for b in starts if b["type"] == "tool_use"]
    assert len(uses) == 1 and uses[0]["name"] == "get_weather"
    partial = "".join(
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    )
    assert weather_ok({"name": "get_weather", "arguments": json.loads(partial)})
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["delta"]["stop_reason"] == "tool_use"
