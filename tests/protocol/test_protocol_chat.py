"""The chat fields of generate (messages, tools, stop, logprobs) and count_tokens, at the edge."""

from __future__ import annotations

import pytest

from moed.protocol import ErrorCode, MessageType, ProtocolError, validate_request

USER = [{"role": "user", "content": "hi"}]


def gen(**fields):
    return {"v": 1, "type": "generate", "id": 1, **fields}


@pytest.mark.parametrize(
    "msg",
    [
        gen(messages=USER),
        gen(messages=USER, tools=[{"type": "function", "function": {"name": "f"}}]),
        gen(prompt="x", stop=["\n", "END"], logprobs=0),
        gen(prompt_ids=[1, 2], logprobs=20),
        {"v": 1, "type": "count_tokens", "id": 2, "messages": USER},
        {"v": 1, "type": "count_tokens", "id": 2, "prompt": "x", "raw": True},
    ],
)
def test_accepted(msg):
    assert validate_request(msg) == (MessageType(msg["type"]), msg["id"])


@pytest.mark.parametrize(
    "msg",
    [
        gen(messages=USER, prompt="x"),
        gen(messages=[]),
        gen(messages="hi"),
        gen(messages=[{"role": "robot", "content": "x"}]),
        gen(messages=[{"role": "user", "content": 5}]),
        gen(messages=[{"role": "user", "content": "x", "tool_calls": "f()"}]),
        gen(messages=USER, raw=True),
        gen(prompt="x", tools=[{}]),
        gen(messages=USER, tools=["f"]),
        gen(prompt="x", stop="END"),
        gen(prompt="x", stop=[""]),
        gen(prompt="x", stop=["s"] * 17),
        gen(prompt="x", stop=["s" * 257]),
        gen(prompt="x", logprobs=21),
        gen(prompt="x", logprobs=True),
        {"v": 1, "type": "count_tokens", "id": 2},
        {"v": 1, "type": "count_tokens", "id": 2, "prompt_ids": [1]},
    ],
)
def test_refused_as_invalid_request(msg):
    with pytest.raises(ProtocolError) as err:
        validate_request(msg)
    assert err.value.code is ErrorCode.INVALID_REQUEST
