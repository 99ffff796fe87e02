"""The engine's typed events (protocol/events.py): each `to_wire` writes exactly the map the
daemon has always sent (PROTOCOL.md's examples and the literal maps below, byte for byte as
msgpack), each `from_wire` reads it back to an equal event, and the client decodes a stream's
messages into these same classes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moed.client import ProgressEvent, RequestFailed
from moed.client.events import event_from_message
from moed.protocol import (
    TERMINAL_EVENTS,
    Channel,
    DoneEvent,
    EngineEvent,
    ErrorCode,
    FailedEvent,
    FinishReason,
    LoadProgress,
    PromptProgress,
    TelemetryEvent,
    TokenEvent,
    TraceEvent,
    encode,
    event_from_wire,
)
from moed.protocol.errors import BudgetExceeded

SPEC = Path(__file__).parents[2] / "protocol" / "PROTOCOL.md"
STREAM_TYPES = {"token", "telemetry", "done", "progress", "error", "trace"}

# One of each event, with every optional part present in some and absent in others.
EVENTS: list[EngineEvent] = [
    TokenEvent(0, [412], "\n    if"),
    TokenEvent(
        3,
        [7, 8],
        "<think>",
        logprobs=[{"id": 7, "token": "a", "logprob": -0.5, "top": []}],
        channel=Channel.REASONING,
    ),
    TokenEvent(4, [], "", tool_calls=[{"id": "call_0", "name": "f", "arguments": {"x": 1}}]),
    PromptProgress(0, 12),
    PromptProgress(512, 4096),
    LoadProgress("loading weights", 1048576000, 2097152000, "bytes"),
    LoadProgress("reading the checkpoint", 0, None, "steps"),
    TelemetryEvent({"tokens": 16, "experts": {"hits": 3, "misses": 1}}),
    TelemetryEvent({"warning": "the trace file could not be written"}),
    TraceEvent(0, b"MOETRACE\x00\x01"),
    DoneEvent(FinishReason.LENGTH, {"prompt_tokens": 6}, {"ttft_s": 0.04}, {"tokens": 64}),
    DoneEvent(
        FinishReason.STOP,
        {"prompt_tokens": 6, "completion_tokens": 2, "cached_tokens": 0},
        {"total_s": 0.1},
        {"tokens": 2},
        stop_sequence="\n\n",
        lossy={"active_experts": 4, "native_experts": 8, "lossy": True},
        notice="max_tokens capped at 2 (the context left after the prompt)",
    ),
    FailedEvent.of(ErrorCode.OUT_OF_MEMORY, "shed"),
    FailedEvent.refusal(
        BudgetExceeded(
            ErrorCode.PROMPT_TOO_LONG, "too long", prompt_tokens=90, max_tokens=None, limit=64
        )
    ),
]


def _spec_examples() -> list[tuple[str, dict]]:
    blocks = re.findall(r"```json (\w+)\n(.*?)\n```", SPEC.read_text(), re.S)
    return [(kind, json.loads(body)) for kind, body in blocks if kind in STREAM_TYPES]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_to_wire_then_from_wire_is_the_same_event(event):
    msg = event.to_wire("req-7")
    assert msg["v"] == 1 and msg["id"] == "req-7"
    assert type(event).from_wire(msg) == event
    assert event_from_wire(msg) == event
    assert isinstance(event, TERMINAL_EVENTS) == (msg["type"] in ("done", "error"))


def test_the_spec_examples_of_a_stream_are_read_and_written_back():
    examples = _spec_examples()
    assert {kind for kind, _ in examples} >= {"token", "telemetry", "done", "progress", "error"}
    for kind, msg in examples:
        event = event_from_wire(msg)
        assert event is not None, kind
        written = event.to_wire(msg["id"])
        if (
            kind == "done" and "telemetry" not in msg
        ):  # an abbreviated `done` (a daemon's always carries telemetry)
            assert written.pop("telemetry") == {}
        assert written == msg, kind


# The maps the daemon sent before the events had types, written out key by key.
LITERAL = [
    (
        TokenEvent(2, [5], "hi", None, None, Channel.ANSWER),
        {"v": 1, "type": "token", "id": 9, "index": 2, "ids": [5], "text": "hi"},
    ),
    (
        TokenEvent(2, [5], "hm", [{"id": 5, "logprob": -1.0}], None, Channel.REASONING),
        {
            "v": 1,
            "type": "token",
            "id": 9,
            "index": 2,
            "ids": [5],
            "text": "hm",
            "channel": "reasoning",
            "logprobs": [{"id": 5, "logprob": -1.0}],
        },
    ),
    (
        TokenEvent(3, [], "", None, [{"id": "c", "name": "f", "arguments": {}}]),
        {
            "v": 1,
            "type": "token",
            "id": 9,
            "index": 3,
            "ids": [],
            "text": "",
            "tool_calls": [{"id": "c", "name": "f", "arguments": {}}],
        },
    ),
    (
        PromptProgress(10, 40),
        {
            "v": 1,
            "type": "progress",
            "id": 9,
            "stage": "reading the prompt",
            "done": 10,
            "total": 40,
            "unit": "tokens",
        },
    ),
    (
        LoadProgress("loading weights", 3.0, None, "steps"),
        {
            "v": 1,
            "type": "progress",
            "id": 9,
            "stage": "loading weights",
            "done": 3.0,
            "total": None,
            "unit": "steps",
        },
    ),
    (
        TelemetryEvent({"warning": "disk full"}),
        {"v": 1, "type": "telemetry", "id": 9, "data": {"warning": "disk full"}},
    ),
    (TraceEvent(4, b"\x01\x02"), {"v": 1, "type": "trace", "id": 9, "seq": 4, "data": b"\x01\x02"}),
    (
        DoneEvent(FinishReason.CANCELLED, {"prompt_tokens": 1}, {}, {"tokens": 0}, None, None, "n"),
        {
            "v": 1,
            "type": "done",
            "id": 9,
            "finish_reason": "cancelled",
            "usage": {"prompt_tokens": 1},
            "timings": {},
            "telemetry": {"tokens": 0},
            "notice": "n",
        },
    ),
    (
        FailedEvent.refusal(
            BudgetExceeded(
                ErrorCode.CONTEXT_EXCEEDED, "over", prompt_tokens=9, max_tokens=99, limit=64
            )
        ),
        {
            "v": 1,
            "type": "error",
            "id": 9,
            "code": "context_exceeded",
            "message": "over",
            "retryable": False,
            "budget": {"prompt_tokens": 9, "limit": 64, "max_tokens": 99},
        },
    ),
    (
        FailedEvent.of(ErrorCode.SHUTTING_DOWN, "bye"),
        {
            "v": 1,
            "type": "error",
            "id": 9,
            "code": "shutting_down",
            "message": "bye",
            "retryable": True,
        },
    ),
]


@pytest.mark.parametrize("event,literal", LITERAL, ids=lambda x: type(x).__name__)
def test_each_event_is_todays_map_byte_for_byte(event, literal):
    assert encode(event.to_wire(9)) == encode(literal)
    assert event_from_wire(literal) == event


def test_the_client_reads_the_same_classes():
    for event, literal in LITERAL:
        if isinstance(event, FailedEvent):
            with pytest.raises(RequestFailed) as failed:
                event_from_message(literal)
            assert failed.value.code is event.code and failed.value.budget == event.budget
            assert failed.value.retryable is event.retryable
            continue
        assert event_from_message(literal) == event
    # Either progress reads as the client's ProgressEvent, with stage, done, total and unit.
    for progress in (PromptProgress(1, 2), LoadProgress("loading weights", 1, 2, "bytes")):
        assert isinstance(progress, ProgressEvent)
        assert (progress.stage, progress.unit) == (
            progress.to_wire(0)["stage"],
            progress.to_wire(0)["unit"],
        )


def test_what_a_newer_daemon_adds_is_read_without_failing():
    assert event_from_wire({"v": 1, "type": "thought", "id": 1}) is None
    failed = event_from_wire(
        {"v": 1, "type": "error", "id": 1, "code": "brand_new", "message": "m", "retryable": True}
    )
    assert failed == FailedEvent("brand_new", "m", True)
    assert failed.to_wire(1)["code"] == "brand_new"
    # A finish reason or a channel this version does not know is kept as its text, both ways.
    done = event_from_wire(
        {"v": 1, "type": "done", "id": 1, "finish_reason": "handed_off", "usage": {}}
    )
    assert isinstance(done, DoneEvent) and done.finish_reason == "handed_off"
    assert done.to_wire(1)["finish_reason"] == "handed_off"
    token = event_from_wire(
        {"v": 1, "type": "token", "id": 1, "index": 0, "ids": [5], "text": "x", "channel": "aside"}
    )
    assert isinstance(token, TokenEvent) and token.channel == "aside"
    assert token.to_wire(1)["channel"] == "aside"


def test_the_enums_a_client_shows_read_as_their_text():
    done = DoneEvent.from_wire(LITERAL[7][1])
    assert f"finish {done.finish_reason}" == "finish cancelled"
    assert str(Channel.REASONING) == "reasoning"
