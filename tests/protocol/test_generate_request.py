"""The typed generate request: built once by validation, to_wire and back over every field, and a
bad field refused with the wire's typed error."""

from __future__ import annotations

import dataclasses

import pytest

from moed.client import RequestFailed
from moed.client.requests import checked_request
from moed.protocol import (
    ErrorCode,
    GenerateRequest,
    MessageType,
    NamedTool,
    ProtocolError,
    ResponseFormat,
    decode,
    encode,
    validate_generate,
    validate_request,
)
from moed.protocol import messages as wire
from moed.protocol.constraints import FormatType, ToolChoice
from moed.protocol.generate import GENERATE_FIELDS
from moed.protocol.rules import Limits
from moed.protocol.units import KeepAliveDuration
from moed.protocol.validation import resolve_max_tokens

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}

# Every field away from its default (prompt, prompt_ids and messages are exclusive: three cases).
SHARED = dict(
    resume_ids=(7, 8),
    max_tokens=40,
    temperature=0.7,
    top_p=0.9,
    seed=11,
    model="tiny",
    trace=True,
    progress=True,
    telemetry_every=4,
    stop=("\n\n", "END"),
    logprobs=3,
    keep_alive=KeepAliveDuration("5m"),
    parallel_tool_calls=False,
    caller="10.0.0.7",
)
CHAT = GenerateRequest(
    messages=({"role": "user", "content": "weather?"},),
    tools=(TOOL,),
    tool_choice=NamedTool("get_weather"),
    chat_template_kwargs={"enable_thinking": False},
    principal="key:0123456789abcdef",
    cache_salt="a-salt-of-this-tenant",
    **SHARED,
)
TEXT = GenerateRequest(
    prompt="def f(",
    raw=True,
    format=ResponseFormat(FormatType.JSON_SCHEMA, {"type": "object"}),
    **SHARED,
)
IDS = GenerateRequest(
    prompt_ids=(5, 17, 33),
    format=ResponseFormat(FormatType.JSON),
    strict_max_tokens=True,
    open_ended=True,
    **SHARED,
)


def test_every_field_has_its_rule():
    names = [f.name for f in dataclasses.fields(GenerateRequest)]
    assert list(GENERATE_FIELDS) == names


@pytest.mark.parametrize("request_", [CHAT, TEXT, IDS], ids=["messages", "prompt", "prompt_ids"])
def test_to_wire_and_back_over_every_field(request_):
    msg = request_.to_wire("r-1")
    assert validate_request(msg) == (MessageType.GENERATE, "r-1")
    # Through the codec, as the daemon receives it: the same typed request.
    assert validate_generate(decode(encode(msg))) == request_
    # And the wire form again, field for field and byte for byte.
    assert encode(validate_generate(msg).to_wire("r-1")) == encode(msg)


def test_every_field_is_covered():
    """The round trip above leaves no field at its default in one of its three requests."""
    for f in dataclasses.fields(GenerateRequest):
        assert any(getattr(r, f.name) != f.default for r in (CHAT, TEXT, IDS)), f.name


def test_defaults_stay_off_the_wire():
    msg = GenerateRequest(prompt="hi").to_wire(3)
    assert msg == {"v": 1, "type": "generate", "id": 3, "prompt": "hi"}
    # false is sent where it differs from the default (parallel_tool_calls: none means true).
    msg = GenerateRequest(prompt="hi", parallel_tool_calls=False).to_wire(3)
    assert msg["parallel_tool_calls"] is False


def test_values_are_typed():
    req = validate_generate(
        wire.request(
            MessageType.GENERATE,
            1,
            messages=[{"role": "user", "content": "x"}],
            tools=[TOOL],
            tool_choice="required",
            format=None,
            stop=["a"],
        )
    )
    assert req.tool_choice is ToolChoice.REQUIRED and req.forced_tool_calls
    assert req.stop == ("a",) and req.tools == (TOOL,)
    assert req.templated and req.template_tools == (TOOL,)
    none = dataclasses.replace(req, tool_choice=ToolChoice.NONE)
    assert none.template_tools is None and not none.forced_tool_calls
    fmt = validate_generate(
        wire.request(MessageType.GENERATE, 1, prompt="x", format={"type": "json"})
    )
    assert fmt.format == ResponseFormat(FormatType.JSON) and fmt.templated
    raw = validate_generate(wire.request(MessageType.GENERATE, 1, prompt="x", raw=True))
    assert not raw.templated


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"prompt": "x", "temperature": float("nan")}, ErrorCode.INVALID_REQUEST, "finite"),
        ({"prompt": "x", "top_p": 0}, ErrorCode.INVALID_REQUEST, "'top_p'"),
        ({"prompt": "x", "format": {"type": "yaml"}}, ErrorCode.INVALID_REQUEST, "format.type"),
        ({"prompt_ids": [1, 99]}, ErrorCode.INVALID_REQUEST, "vocabulary"),
        ({"prompt": "x" * 5000}, ErrorCode.PROMPT_TOO_LONG, "over"),
        ({"prompt": "x", "cache_salt": ""}, ErrorCode.INVALID_REQUEST, "'cache_salt'"),
        ({"prompt": "x", "cache_salt": 7}, ErrorCode.INVALID_REQUEST, "must be a string"),
        ({"prompt": "x", "principal": ""}, ErrorCode.INVALID_REQUEST, "'principal'"),
        ({"prompt": "x", "principal": "p" * 300}, ErrorCode.INVALID_REQUEST, "characters"),
    ],
)
def test_a_bad_field_is_the_wire_error(fields, code, words):
    limits = Limits(vocab_size=50, max_prompt_tokens=100)
    msg = wire.request(MessageType.GENERATE, 9, **fields)
    with pytest.raises(ProtocolError) as typed:
        validate_generate(msg, limits)
    with pytest.raises(ProtocolError) as checked:
        validate_request(msg, limits)
    assert typed.value.code == checked.value.code == code
    assert typed.value.message == checked.value.message and words in typed.value.message


def test_only_a_generate_becomes_one():
    with pytest.raises(ProtocolError) as refused:
        validate_generate(wire.request(MessageType.PING, 1))
    assert refused.value.code is ErrorCode.UNKNOWN_TYPE


def test_the_clients_check_fields_as_the_daemon_does():
    assert checked_request(prompt="hi", max_tokens=3, raw=True) == GenerateRequest(
        prompt="hi", max_tokens=3, raw=True
    )
    with pytest.raises(RequestFailed) as failed:
        checked_request(prompt="hi", tool_choice="required")
    assert (
        failed.value.code is ErrorCode.INVALID_REQUEST and "needs 'tools'" in failed.value.message
    )
    with pytest.raises(TypeError):
        checked_request(prompt="hi", max_token=3)  # a misspelt field is not dropped silently


def test_open_ended_runs_to_the_limit_and_the_context_without_max_tokens():
    """Without max_tokens a request gets default_max_tokens, an open-ended one the rest of the
    context under limits.max_tokens; a max_tokens given wins either way."""
    limits = Limits(context_tokens=1000, max_tokens=800, default_max_tokens=16)
    assert resolve_max_tokens(None, 10, limits) == 16
    assert resolve_max_tokens(None, 10, limits, open_ended=True) == 800
    assert resolve_max_tokens(None, 300, limits, open_ended=True) == 700
    assert resolve_max_tokens(5, 10, limits, open_ended=True) == 5


@pytest.mark.parametrize(
    ("written", "seconds"), [("5m", 300.0), (90, 90.0), ("-1", None), (0, 0.0)]
)
def test_keep_alive_is_decoded_once_at_the_edge(written, seconds):
    """The engine reads the seconds the edge decoded (None: never); the wire keeps the spelling."""
    req = validate_generate(wire.request(MessageType.GENERATE, 1, prompt="x", keep_alive=written))
    assert req.keep_alive == KeepAliveDuration(written) and req.keep_alive.seconds == seconds
    assert req.to_wire(1)["keep_alive"] == written
    with pytest.raises(ValueError, match="not a duration"):
        KeepAliveDuration("soon")
