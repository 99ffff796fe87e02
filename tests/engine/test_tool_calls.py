"""Tool calls cut out of a streamed completion with mlx-lm's parser for the model's template."""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import load_tokenizer

from moed.daemon.engine.tool_calls import ToolCalls
from tests.fixtures.tokenizer import write_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    wrapper = load_tokenizer(folder)
    assert wrapper.has_tool_calling  # inferred from the template: the json_tools parser
    return wrapper


def run(calls: ToolCalls, deltas: list[str]) -> tuple[str, list[dict]]:
    text, found = [], []
    for delta in deltas:
        t, c = calls.feed(delta)
        text.append(t)
        found += c
    t, c = calls.flush()
    return "".join(text) + t, found + c


@pytest.mark.parametrize("cut", [1, 5, 11, 40, len(CALL) - 3])
def test_a_call_split_anywhere_is_cut_out_and_parsed(tokenizer, cut):
    stream = "Let me look. " + CALL + " Done."
    text, found = run(ToolCalls(tokenizer, TOOLS), [stream[:cut], stream[cut:]])
    assert text == "Let me look.  Done."
    assert [(c["name"], c["arguments"]) for c in found] == [("get_weather", {"city": "Paris"})]
    assert found[0]["id"].startswith("call_")


def test_text_without_tools_passes_untouched(tokenizer):
    assert run(ToolCalls(tokenizer, None), ["a <tool_call>", "b"]) == ("a <tool_call>b", [])


def test_a_false_start_and_an_unparsable_unterminated_call_come_back_as_text(tokenizer):
    assert run(ToolCalls(tokenizer, TOOLS), ["x <tool", "box> y"]) == ("x <toolbox> y", [])
    text, found = run(ToolCalls(tokenizer, TOOLS), ["a <tool_call>{not json"])
    assert (text, found) == ("a <tool_call>{not json", [])


def test_an_unterminated_call_that_parses_is_a_call(tokenizer):
    calls = ToolCalls(tokenizer, TOOLS)
    text, found = run(calls, ['<tool_call>{"name": "get_weather", "arguments": {}}'])
    assert text == "" and found[0]["name"] == "get_weather" and calls.made == 1


def test_a_call_cut_short_is_dropped_never_text(tokenizer):
    """max_tokens cut the answer inside a call (or inside its start marker): nothing of it is
    text, and no half call goes out."""
    for deltas in (
        ["a <tool_call>{not json"],
        ['<tool_call>{"name": "get_weather", "arguments": {}}'],
        ["a <tool_c"],
    ):
        calls = ToolCalls(tokenizer, TOOLS)
        text = "".join(calls.feed(d)[0] for d in deltas)
        rest, found = calls.flush(cut=True)
        assert (text + rest, found) == ("a " if deltas[0].startswith("a") else "", []), deltas
