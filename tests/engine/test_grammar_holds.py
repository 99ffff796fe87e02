"""Structured output keeps its promise or refuses, through a real daemon on the agent checkpoint
(Qwen3.6's think markers): no `oneOf` weakened to `anyOf`; integer-valued counts accepted; a
schema whose grammar meets a dead end fails typed instead of ending as broken JSON with `stop`; a
`const` holding a think marker stays in the answer; resumed tokens that spell the think end do
not let the answer out of the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from mlx_lm.utils import load_tokenizer

from moed.client import DoneEvent, RequestFailed, TokenEvent
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import start_daemon
from tests.fixtures.tokenizer import THINK_END, THINK_START, ChatStyle

pytestmark = pytest.mark.process

MAX_TOKENS = 120
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module")
def agent_model(checkpoint_factory):
    return checkpoint_factory("qwen3_moe", chat=ChatStyle.AGENT)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, agent_model):
    d = start_daemon(tmp_path_factory.mktemp("holds"), agent_model, "--resident")
    yield d
    d.stop()


def answer(daemon, schema: dict, **request) -> tuple[str, str, DoneEvent | RequestFailed]:
    """(answer text, reasoning text, the end) of one generation under `schema`."""
    fields = {
        "messages": [{"role": "user", "content": "reply as JSON"}],
        "format": {"type": "json_schema", "schema": schema},
        "max_tokens": MAX_TOKENS,
        **request,
    }
    text, reasoning = [], []
    with daemon.client() as c:
        try:
            for event in c.generate(**fields):
                if isinstance(event, TokenEvent):
                    (reasoning if event.channel == "reasoning" else text).append(event.text)
                elif isinstance(event, DoneEvent):
                    return "".join(text), "".join(reasoning), event
        except RequestFailed as exc:
            return "".join(text), "".join(reasoning), exc
    raise AssertionError("no end")


def assert_valid(text: str, end, schema: dict) -> None:
    assert isinstance(end, DoneEvent) and end.finish_reason == "stop", (end, text)
    jsonschema.validate(json.loads(text), schema)


def test_an_overlapping_one_of_is_refused_never_weakened(daemon):
    """Both branches match `", "`: an anyOf would accept it; the answer must match one."""
    schema = {"type": "string", "oneOf": [{"minLength": 2}, {"maxLength": 4}]}
    _, _, end = answer(daemon, schema, chat_template_kwargs=NO_THINKING)
    assert isinstance(end, RequestFailed) and end.code is ErrorCode.INVALID_SCHEMA, end
    assert "oneOf" in end.message and "anyOf" in end.message


@pytest.mark.parametrize(
    "schema",
    [
        {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
        {"oneOf": [{"const": "#FF0000", "title": "Red"}, {"const": "#00FF00", "title": "Green"}]},
        {
            "type": "object",
            "oneOf": [
                {"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                {"properties": {"kind": {"const": "b"}}, "required": ["kind"]},
            ],
            "properties": {"kind": {"enum": ["a", "b"]}},
            "required": ["kind"],
            "additionalProperties": False,
        },
        {"type": "array", "items": {"enum": [1, 2]}, "minItems": 1.0, "maxItems": 2.0},
    ],
    ids=["types", "titled-consts", "discriminated", "integer-valued-counts"],
)
def test_exact_one_of_and_integer_valued_counts_hold(daemon, schema):
    text, _, end = answer(daemon, schema, chat_template_kwargs=NO_THINKING)
    assert_valid(text, end, schema)


def test_a_grammar_dead_end_fails_typed_not_as_broken_json(daemon):
    """A recursive $ref whose every object requires another: llguidance compiles it and then
    allows `{` and nothing after; the answer used to end there with `stop`."""
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"next": {"$ref": "#/$defs/node"}},
                "required": ["next"],
            }
        },
        "$ref": "#/$defs/node",
    }
    _, _, end = answer(daemon, schema, chat_template_kwargs=NO_THINKING)
    assert isinstance(end, RequestFailed) and end.code is ErrorCode.INVALID_SCHEMA, end
    assert not end.retryable


@pytest.mark.parametrize("marker", [THINK_START, THINK_END])
def test_a_think_marker_in_a_const_or_enum_stays_in_the_answer(daemon, marker):
    schema = {
        "type": "object",
        "properties": {"m": {"const": marker}, "n": {"enum": [THINK_END + THINK_START]}},
        "required": ["m", "n"],
        "additionalProperties": False,
    }
    text, reasoning, end = answer(daemon, schema, chat_template_kwargs=NO_THINKING)
    assert_valid(text, end, schema)
    assert reasoning == ""


def test_resumed_tokens_that_spell_the_think_end_do_not_free_the_answer(daemon, agent_model):
    """The prompt opens the reasoning; the resumed tokens spell `</think>` with ordinary tokens
    (not the marker's own token). The reasoning goes on, as the grammar waits for the marker's
    token: whatever answer follows is held to the schema."""
    tok = load_tokenizer(agent_model)
    marker_id = tok.convert_tokens_to_ids(THINK_END)
    spelled = [i for part in ("</", "think", ">") for i in tok.encode(part)]
    assert marker_id not in spelled and tok.decode(spelled) == THINK_END
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for seed in (None, 1, 2):
        sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {}
        text, _, end = answer(daemon, schema, resume_ids=spelled, **sampling)
        assert isinstance(end, DoneEvent), end
        if text or end.finish_reason == "stop":
            assert_valid(text, end, schema)
