"""The wire schema and codec, and the examples of PROTOCOL.md (the spec a third party reads)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgpack
import pytest

from moed.protocol import (
    RETRYABLE,
    ErrorCode,
    MessageType,
    ProtocolError,
    decode,
    encode,
    validate_request,
)
from moed.protocol import messages as wire

SPEC = Path(__file__).parents[2] / "protocol" / "PROTOCOL.md"


def spec_examples() -> list[tuple[str, str]]:
    return re.findall(r"```json (\w+)\n(.*?)\n```", SPEC.read_text(), re.S)


def test_spec_has_an_example_per_core_type():
    kinds = {kind for kind, _ in spec_examples()}
    assert {
        "hello",
        "welcome",
        "generate",
        "token",
        "telemetry",
        "done",
        "error",
        "cancel",
        "result",
        "ping",
    } <= kinds


@pytest.mark.parametrize("kind,body", spec_examples())
def test_spec_examples_decode_and_validate(kind, body):
    msg = json.loads(body)
    assert msg["type"] == kind
    assert decode(encode(msg)) == msg  # survives the msgpack codec unchanged
    if MessageType(kind) in {
        MessageType(t)
        for t in ("hello", "generate", "cancel", "ping", "shed", "status", "shutdown")
    }:
        assert validate_request(msg) == (MessageType(kind), msg["id"])
    if kind == "error":
        assert ErrorCode(msg["code"]) and msg["retryable"] == (ErrorCode(msg["code"]) in RETRYABLE)


def test_spec_lists_every_error_code():
    text = SPEC.read_text()
    for code in ErrorCode:
        assert f"`{code.value}`" in text, code


@pytest.mark.parametrize(
    "msg,code",
    [
        ([1, 2], ErrorCode.BAD_FRAME),
        ({"type": "ping", "id": 1}, ErrorCode.INVALID_REQUEST),
        ({"v": 2, "type": "ping", "id": 1}, ErrorCode.UNSUPPORTED_VERSION),
        ({"v": 1, "type": "fly", "id": 1}, ErrorCode.UNKNOWN_TYPE),
        ({"v": 1, "type": "token", "id": 1}, ErrorCode.UNKNOWN_TYPE),
        ({"v": 1, "type": "ping"}, ErrorCode.INVALID_REQUEST),
        ({"v": 1, "type": "ping", "id": 1.5}, ErrorCode.INVALID_REQUEST),
        ({"v": 1, "type": "generate", "id": 1}, ErrorCode.INVALID_REQUEST),
        ({"v": 1, "type": "generate", "id": 1, "prompt": 5}, ErrorCode.INVALID_REQUEST),
        (
            {"v": 1, "type": "generate", "id": 1, "prompt": "a", "prompt_ids": [1]},
            ErrorCode.INVALID_REQUEST,
        ),
        ({"v": 1, "type": "generate", "id": 1, "prompt_ids": ["a"]}, ErrorCode.INVALID_REQUEST),
        (
            {"v": 1, "type": "generate", "id": 1, "prompt": "a", "max_tokens": 0},
            ErrorCode.INVALID_REQUEST,
        ),
        (
            {"v": 1, "type": "generate", "id": 1, "prompt": "a", "max_tokens": True},
            ErrorCode.INVALID_REQUEST,
        ),
        (
            {"v": 1, "type": "generate", "id": 1, "prompt": "a", "top_p": 1.5},
            ErrorCode.INVALID_REQUEST,
        ),
        ({"v": 1, "type": "cancel", "id": 1}, ErrorCode.INVALID_REQUEST),
        ({"v": 1, "type": "shed", "id": 1, "level": "everything"}, ErrorCode.INVALID_REQUEST),
    ],
)
def test_invalid_requests_get_typed_errors(msg, code):
    with pytest.raises(ProtocolError) as info:
        validate_request(msg)
    assert info.value.code is code


def test_codec_refuses_garbage_ext_types_and_oversize():
    with pytest.raises(ProtocolError) as info:
        decode(b"\xc1\xff\x00")
    assert info.value.code is ErrorCode.BAD_FRAME
    with pytest.raises(ProtocolError) as info:
        decode(msgpack.packb(msgpack.ExtType(1, b"x")))
    assert info.value.code is ErrorCode.BAD_FRAME
    with pytest.raises(ProtocolError) as info:
        decode(b"\x00" * 100, max_bytes=10)
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_reply_builders_carry_envelope():
    msg = wire.error("x", ErrorCode.OVERLOADED, "busy")
    assert msg == {
        "v": 1,
        "type": "error",
        "id": "x",
        "code": "overloaded",
        "message": "busy",
        "retryable": True,
    }
    assert wire.request(MessageType.GENERATE, 3, prompt="hi", seed=None) == {
        "v": 1,
        "type": "generate",
        "id": 3,
        "prompt": "hi",
    }
