"""One request's text path is contained: a stage that raises (detokenizing, the reasoning split,
stops, tool calls, the grammar, logprobs) fails that request alone with `poison_request`, while
the other streams of the batch run on unchanged and the daemon keeps serving. Faults are injected
at each stage (ground/faults.py, `text_<stage>_after`) into a real daemon's hostile requests."""

from __future__ import annotations

import pytest

from moed.client import DoneEvent, RequestFailed
from moed.daemon.ground.faults import HOSTILE_MARKER, TextStage
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import run_together, start_daemon
from tests.fixtures.tokenizer import ChatStyle

pytestmark = pytest.mark.process

FAULT_AFTER = 3  # each hostile request streams this many tokens before its stage raises
MAX_TOKENS = 40
WINDOW_MS = "1500"  # an idle daemon gathers the requests of one run into one batch
NO_THINKING = {"enable_thinking": False}  # the answer's stages (tools, stops) from the start
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
# What each stage needs to be reached at all.
STAGE_FIELDS = {
    TextStage.GRAMMAR: {"format": {"type": "json"}},
    TextStage.LOGPROBS: {"logprobs": 2},
    TextStage.STOPS: {"stop": ["never said"]},
    TextStage.TOOL_CALLS: {"tools": [TOOL]},
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, checkpoint_factory):
    model = checkpoint_factory("qwen3_moe", chat=ChatStyle.AGENT)
    faults = ",".join(f"text_{stage.value}_after={FAULT_AFTER}" for stage in TextStage)
    d = start_daemon(
        tmp_path_factory.mktemp("text-path"),
        model,
        "--resident",
        "--max-batch",
        "16",
        "--batch-window-ms",
        WINDOW_MS,
        env={"MOED_DEBUG_FAULTS": faults},
    )
    yield d
    d.stop()


def _request(stage: TextStage, hostile: bool) -> dict:
    """The same request, with or without the marker that arms the stage's fault."""
    word = HOSTILE_MARKER if hostile else "moed-friendly-request"
    return {
        "messages": [{"role": "user", "content": f"tell a story {word}:{stage.value}"}],
        "chat_template_kwargs": NO_THINKING,
        **STAGE_FIELDS.get(stage, {}),
    }


def test_each_stage_fails_its_request_alone_and_the_batch_runs_on(daemon):
    benign = [
        {"messages": [{"role": "user", "content": "the quick brown fox"}]},
        {
            "messages": [{"role": "user", "content": "hello world paris robot"}],
            "seed": 3,
            "temperature": 1.0,
        },
    ]
    stages = list(TextStage)
    calm = run_together(daemon, benign + [_request(s, hostile=False) for s in stages], MAX_TOKENS)
    results = run_together(daemon, benign + [_request(s, hostile=True) for s in stages], MAX_TOKENS)
    with daemon.client() as c:
        assert c.status()["peak_running_requests"] == len(benign) + len(stages)  # one batch
    for (got, end), (want, _) in zip(results[: len(benign)], calm):
        assert isinstance(end, DoneEvent) and end.finish_reason == "length", end
        assert got == want  # the other rows ran on, token for token
    for stage, (got, end) in zip(stages, results[len(benign) :]):
        assert isinstance(end, RequestFailed), (stage, end)
        assert end.code is ErrorCode.POISON_REQUEST and stage.value in end.message, (stage, end)
        assert not end.retryable
        if stage is not TextStage.GRAMMAR:  # the grammar runs a position ahead of its token
            assert len(got) >= FAULT_AFTER, (stage, got)
    assert daemon.proc.poll() is None
    with daemon.client() as c:  # and it serves the next request as before
        again = list(c.generate(messages=benign[0]["messages"], max_tokens=MAX_TOKENS))
        assert isinstance(again[-1], DoneEvent)
        assert c.status()["requests_failed"] == len(stages)


# Qwen3.6's XML tool-call format, and a parameter whose schema is `true` (any value): mlx-lm's
# qwen3_coder parser raised TypeError on it, which took the engine loop and the daemon down.
ANYTHING_GOES = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"body": True, "tag": {"type": "string", "maxLength": 8}},
            "required": ["body", "tag"],
        },
    },
}


def test_a_tool_parameter_of_schema_true_never_takes_the_daemon_down(daemon):
    benign = {"messages": [{"role": "user", "content": "the quick brown fox"}]}
    forced = {
        "messages": [{"role": "user", "content": "take a note"}],
        "tools": [ANYTHING_GOES],
        "tool_choice": {"name": "note"},
        "chat_template_kwargs": NO_THINKING,
        "max_tokens": 200,  # room for the whole call (greedy, it is three tokens of value)
    }
    (_, alone), (_, end) = run_together(daemon, [benign, forced], MAX_TOKENS)
    assert isinstance(alone, DoneEvent) and alone.finish_reason == "length", alone
    assert isinstance(end, DoneEvent), end
    assert daemon.proc.poll() is None
