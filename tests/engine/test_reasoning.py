"""Reasoning told apart from the answer with the template's think markers: the daemon streams the
two channels apart (their concatenation is what the model generated, markers cut), the template's
enable_thinking switch, and each HTTP API's own shape (OpenAI reasoning_content, Ollama thinking,
Anthropic thinking blocks), history with reasoning rendered back."""

from __future__ import annotations

import json

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from moed.daemon.engine.reasoning import ReasoningSplit, initial_channel
from moed.protocol import Channel
from tests.fixtures.agent_model import (
    Split,
    channels_of,
    detokenized,
    prompts,
    stream,
    without_markers,
)
from tests.fixtures.daemon_harness import start_daemon
from tests.fixtures.gateway_harness import start_gateway
from tests.fixtures.tokenizer import ChatStyle, write_tokenizer

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def agent_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent-tok")
    write_tokenizer(folder, style=ChatStyle.AGENT)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    wrapper = load_tokenizer(folder)
    assert wrapper.has_thinking and wrapper.has_tool_calling  # inferred, as for Qwen3.6
    return wrapper


@pytest.mark.parametrize("cut", [1, 3, 7, 12, 20])
def test_markers_split_anywhere_are_cut_and_switch_the_channel(agent_tokenizer, cut):
    text = "let me see</think>\n\nParis.<think>again</think>done"
    split = ReasoningSplit(agent_tokenizer, True, Channel.REASONING)
    parts = split.feed(text[:cut]) + split.feed(text[cut:]) + split.flush()
    joined: dict[Channel, str] = {Channel.ANSWER: "", Channel.REASONING: ""}
    for channel, piece in parts:
        joined[channel] += piece
    assert joined == {Channel.REASONING: "let me seeagain", Channel.ANSWER: "\n\nParis.done"}
    assert "".join(p for _, p in parts) == without_markers(text)


def test_the_prompt_decides_the_first_channel(agent_tokenizer):
    user = [{"role": "user", "content": "hi"}]
    opened = agent_tokenizer.apply_chat_template(user, add_generation_prompt=True)
    closed = agent_tokenizer.apply_chat_template(
        user, add_generation_prompt=True, enable_thinking=False
    )
    assert initial_channel(agent_tokenizer, opened) is Channel.REASONING
    assert initial_channel(agent_tokenizer, closed) is Channel.ANSWER
    # A model without think markers, or a raw prompt, is all answer.
    assert ReasoningSplit(agent_tokenizer, False).feed("a</think>b") == [
        (Channel.ANSWER, "a</think>b")
    ]


@pytest.fixture(scope="module")
def agent_stack(tmp_path_factory, checkpoint_factory):
    """A daemon on the agent checkpoint and a gateway in front of it, and a prompt whose greedy
    answer has both channels (found by the daemon itself, among a batch of prompts)."""
    model = checkpoint_factory("qwen3_moe", chat=ChatStyle.AGENT)
    tmp = tmp_path_factory.mktemp("agent")
    daemon = start_daemon(tmp / "d", model, "--resident")
    gateway = None
    try:
        gateway = start_gateway(tmp / "g", daemon.socket)
        with daemon.client() as c:
            gateway.model = c.welcome["model"]["name"]  # what the HTTP bodies name
        yield daemon, gateway, load_tokenizer(model)
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop()


@pytest.fixture(scope="module")
def two_channel(agent_stack) -> tuple[str, Split]:
    daemon, _, _ = agent_stack
    with daemon.client() as c:
        for prompt in prompts(24):
            got = stream(c, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS)
            if got.both:
                return prompt, got
    pytest.fail("no greedy answer of 24 prompts left the reasoning")


@pytest.mark.process
def test_channels_arrive_apart_and_concatenate_to_the_generation(agent_stack):
    daemon, _, tok = agent_stack
    seen_both = 0
    with daemon.client() as c:
        for prompt in prompts(8):
            for seed in (None, 3):
                sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {}
                got = stream(
                    c,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=MAX_TOKENS,
                    **sampling,
                )
                generated = detokenized(tok, got.ids)
                # The prompt opened the reasoning; each marker switches the channel.
                assert _runs(got.parts) == channels_of(generated)
                seen_both += got.both
    assert seen_both  # the fixture's prompts do leave the reasoning (greedy or seeded)


@pytest.mark.process
def test_enable_thinking_false_starts_in_the_answer(agent_stack):
    daemon, _, tok = agent_stack
    messages = [{"role": "user", "content": prompts(1)[0]}]
    with daemon.client() as c:
        on = stream(c, messages=messages, max_tokens=24)
        off = stream(
            c, messages=messages, max_tokens=24, chat_template_kwargs={"enable_thinking": False}
        )
    assert on.parts[0][0] == "reasoning"
    assert off.parts and off.parts[0][0] == "answer"
    # The template closed the reasoning in the prompt itself (`<think>\n\n</think>\n\n`).
    assert off.done.usage["prompt_tokens"] > on.done.usage["prompt_tokens"]


def _runs(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive parts of one channel joined (the stream cuts them at token boundaries)."""
    out: list[tuple[str, str]] = []
    for channel, text in parts:
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))
    return out


def _sse(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in response.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


@pytest.mark.process
def test_openai_reasoning_content(agent_stack, two_channel):
    _, gateway, _ = agent_stack
    prompt, direct = two_channel
    body = {
        "model": gateway.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
    }
    url = f"{gateway.url}/v1/chat/completions"
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["message"]
    assert whole["reasoning_content"] == whole["reasoning"] == direct.text("reasoning")
    assert whole["content"] == direct.text("answer")
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        deltas = [c["choices"][0]["delta"] for c in _sse(r) if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == direct.text("reasoning")
    assert "".join(d.get("reasoning", "") for d in deltas) == direct.text("reasoning")
    assert "".join(d.get("content") or "" for d in deltas) == direct.text("answer")
    assert not any("content" in d and "reasoning_content" in d for d in deltas)  # apart
    # reasoning_effort none switches the template's reasoning off: no reasoning comes back.
    off = httpx.post(url, json={**body, "reasoning_effort": "none"}, timeout=60).json()
    assert off["usage"]["prompt_tokens"] > 0
    first = httpx.post(
        url, json={**body, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60
    ).json()
    assert off["choices"][0]["message"] == first["choices"][0]["message"]
    assert off["usage"] == first["usage"]


@pytest.mark.process
def test_openai_history_renders_reasoning_back(agent_stack):
    _, gateway, _ = agent_stack
    url = f"{gateway.url}/v1/chat/completions"

    def prompt_tokens(assistant: dict) -> int:
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", **assistant},
            {"role": "user", "content": "again"},
        ]
        body = {"model": gateway.model, "messages": messages, "max_tokens": 1}
        return httpx.post(url, json=body, timeout=60).json()["usage"]["prompt_tokens"]

    plain = prompt_tokens({})
    assert prompt_tokens({"reasoning_content": "the user greets"}) > plain
    assert prompt_tokens({"reasoning": "the user greets"}) > plain


@pytest.mark.process
def test_ollama_thinking(agent_stack, two_channel):
    _, gateway, _ = agent_stack
    prompt, direct = two_channel
    body = {
        "model": gateway.model,
        "messages": [{"role": "user", "content": prompt}],
        "options": {"num_predict": MAX_TOKENS},
    }
    url = f"{gateway.url}/api/chat"
    whole = httpx.post(url, json={**body, "stream": False}, timeout=60).json()["message"]
    assert whole["thinking"] == direct.text("reasoning")
    assert whole["content"] == direct.text("answer")
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    messages = [line["message"] for line in lines]
    assert "".join(m.get("thinking", "") for m in messages) == direct.text("reasoning")
    assert "".join(m["content"] for m in messages) == direct.text("answer")
    think_off = httpx.post(url, json={**body, "stream": False, "think": False}, timeout=60).json()
    assert (
        think_off["prompt_eval_count"]
        != httpx.post(url, json={**body, "stream": False}, timeout=60).json()["prompt_eval_count"]
    )


@pytest.mark.process
def test_anthropic_thinking_blocks(agent_stack, two_channel):
    _, gateway, _ = agent_stack
    prompt, direct = two_channel
    body = {
        "model": gateway.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "thinking": {"type": "adaptive"},
    }
    url = f"{gateway.url}/v1/messages"
    whole = httpx.post(url, json=body, timeout=60).json()
    kinds = [b["type"] for b in whole["content"]]
    assert kinds[0] == "thinking" and "text" in kinds
    assert whole["content"][0]["thinking"] == direct.text("reasoning")
    assert "".join(b.get("text", "") for b in whole["content"]) == direct.text("answer")
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        events = _sse(r)
    starts = {
        e["index"]: e["content_block"]["type"] for e in events if e["type"] == "content_block_start"
    }
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    thinking = "".join(d["delta"].get("thinking", "") for d in deltas)
    text = "".join(d["delta"].get("text", "") for d in deltas)
    assert (thinking, text) == (direct.text("reasoning"), direct.text("answer"))
    for d in deltas:  # each delta in a block of its own kind
        kind = starts[d["index"]]
        assert (
            d["delta"]["type"]
            in {
                "thinking": ("thinking_delta", "signature_delta"),
                "text": ("text_delta",),
            }[kind]
        )
    # Disabled: the template closes the reasoning, and the history's thinking block renders back.
    off = httpx.post(url, json={**body, "thinking": {"type": "disabled"}}, timeout=60).json()
    assert off["content"][0]["type"] != "thinking"
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "the user greets", "signature": ""},
                {"type": "text", "text": "hello"},
            ],
        },
        {"role": "user", "content": "again"},
    ]
    plain = [history[0], {"role": "assistant", "content": "hello"}, history[2]]
    tokens = [
        httpx.post(url, json={**body, "messages": m, "max_tokens": 1}, timeout=60).json()
        for m in (history, plain)
    ]
    assert tokens[0]["usage"]["input_tokens"] > tokens[1]["usage"]["input_tokens"]


@pytest.mark.process
def test_a_resumed_stream_continues_in_its_channel(agent_stack, two_channel):
    daemon, _, tok = agent_stack
    prompt, direct = two_channel
    messages = [{"role": "user", "content": prompt}]
    end = tok.think_end_tokens[0]
    cut = direct.ids.index(end) + 2  # resumed in the answer, after the end marker
    with daemon.client() as c:
        rest = stream(c, messages=messages, max_tokens=MAX_TOKENS, resume_ids=direct.ids[:cut])
    assert rest.ids == direct.ids[cut:]
    assert rest.parts and rest.parts[0][0] == "answer"
    assert direct.text("answer").endswith(rest.text("answer"))


@pytest.mark.process
def test_moe_run_writes_the_reasoning_to_stderr(agent_stack, two_channel):
    from tests.fixtures.daemon_harness import moe

    daemon, _, _ = agent_stack
    prompt, direct = two_channel
    out = moe(daemon.socket, "run", prompt, "--max-tokens", str(MAX_TOKENS))
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == direct.text("answer").rstrip("\n")
    assert direct.text("reasoning") in out.stderr


@pytest.mark.process
def test_a_schema_holds_the_answer_after_the_reasoning(agent_stack, two_channel):
    daemon, _, tok = agent_stack
    prompt, direct = two_channel
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    with daemon.client() as c:
        got = stream(
            c,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS + 40,
            format={"type": "json_schema", "schema": schema},
        )
    # The mask waits while the reasoning is open (greedy: the same reasoning), then holds the
    # answer.
    assert got.text("reasoning") == channels_of(detokenized(tok, direct.ids))[0][1]
    value = json.loads(got.text("answer"))
    assert set(value) == {"city"} and len(value["city"]) <= 8
    assert got.done.finish_reason == "stop"


@pytest.mark.process
def test_ollama_show_lists_thinking_and_tools(agent_stack):
    _, gateway, _ = agent_stack
    shown = httpx.post(f"{gateway.url}/api/show", json={"model": gateway.model}, timeout=30)
    assert {"thinking", "tools"} <= set(shown.json()["capabilities"])


@pytest.mark.process
def test_responses_reasoning_items_and_json_schema(agent_stack, two_channel):
    """POST /v1/responses: the reasoning as a reasoning item (whole and streamed, apart from the
    message), `reasoning.effort` none switches it off, and `text.format` json_schema holds the
    answer (after the reasoning)."""
    _, gateway, _ = agent_stack
    prompt, direct = two_channel
    url = f"{gateway.url}/v1/responses"
    body = {"model": gateway.model, "input": prompt, "max_output_tokens": MAX_TOKENS}
    whole = httpx.post(url, json=body, timeout=60).json()
    kinds = [item["type"] for item in whole["output"]]
    assert kinds[:2] == ["reasoning", "message"], kinds
    assert whole["output"][0]["content"][0]["text"] == direct.text("reasoning")
    assert whole["output"][1]["content"][0]["text"] == direct.text("answer")
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        events = _sse(r)
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, answer) == (direct.text("reasoning"), direct.text("answer"))
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["type"] for e in done][:2] == ["reasoning", "message"]
    off = httpx.post(url, json={**body, "reasoning": {"effort": "none"}}, timeout=60).json()
    assert [item["type"] for item in off["output"]] == ["message"]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    shaped = httpx.post(
        url,
        json={**body, "max_output_tokens": MAX_TOKENS + 40, "text": {"format": fmt}},
        timeout=60,
    ).json()
    message = next(item for item in shaped["output"] if item["type"] == "message")
    value = json.loads(message["content"][0]["text"])
    assert set(value) == {"city"} and len(value["city"]) <= 8
    bad = httpx.post(url, json={**body, "text": {"format": {"type": "yaml"}}}, timeout=60)
    assert bad.status_code == 400
