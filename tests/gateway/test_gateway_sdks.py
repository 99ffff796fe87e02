"""The gateway driven by the official openai, ollama and anthropic packages against a real daemon:
at temperature 0 the text equals `moe run --json` for the same prompt or messages."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.daemon_harness import moe

pytestmark = pytest.mark.process

PROMPT = "The quick brown fox"
QUESTION = "What is the capital of France?"
N = 10  # tokens per generation: enough text to compare, few enough to stay fast


def moe_run(socket, prompt: str, *flags: str, max_tokens: int = N) -> tuple[str, list[dict]]:
    """`moe run --json`: the completion text and its token lines."""
    out = moe(
        socket, "run", "--json", "--no-start", "--max-tokens", str(max_tokens), *flags, prompt
    )
    assert out.returncode == 0, out.stderr
    tokens = [m for m in map(json.loads, out.stdout.splitlines()) if m["type"] == "token"]
    return "".join(t["text"] for t in tokens), tokens


@pytest.fixture(scope="module")
def stack(gateway_stack):
    return gateway_stack


@pytest.fixture(scope="module")
def model_name(stack) -> str:
    daemon, _ = stack
    with daemon.client() as client:
        return client.welcome["model"]["name"]


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    _, gateway = stack
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    _, gateway = stack
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llama(stack) -> ollama.Client:
    _, gateway = stack
    return ollama.Client(host=gateway.url)


def test_raw_prompt_matches_moe_run(stack, model_name, oai, llama):
    daemon, _ = stack
    expected, _ = moe_run(daemon.socket, PROMPT, "--raw")
    assert expected

    done = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=N, temperature=0)
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == N

    chunks = list(
        oai.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=N, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected

    options = {"num_predict": N, "temperature": 0}
    answer = llama.generate(model=model_name, prompt=PROMPT, raw=True, options=options)
    assert answer.response == expected and answer.done and answer.eval_count == N
    parts = list(
        llama.generate(model=model_name, prompt=PROMPT, raw=True, options=options, stream=True)
    )
    assert "".join(p.response for p in parts) == expected
    assert parts[-1].done and parts[-1].done_reason == "length"


def test_chat_matches_moe_run(stack, model_name, oai, llama, claude):
    daemon, _ = stack
    expected, _ = moe_run(daemon.socket, QUESTION)  # one user turn through the chat template
    messages = [{"role": "user", "content": QUESTION}]

    chat = oai.chat.completions.create(
        model=model_name, messages=messages, max_tokens=N, temperature=0
    )
    assert chat.choices[0].message.content == expected
    assert chat.choices[0].message.role == "assistant"
    chunks = list(
        oai.chat.completions.create(
            model=model_name,
            messages=messages,
            max_completion_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == N and not chunks[-1].choices
    assert chunks[-2].choices[0].finish_reason == "length"

    reply = llama.chat(model=model_name, messages=messages, options={"num_predict": N})
    assert reply.message.content == expected
    streamed = list(
        llama.chat(model=model_name, messages=messages, options={"num_predict": N}, stream=True)
    )
    assert "".join(p.message.content for p in streamed) == expected

    message = claude.messages.create(model=model_name, max_tokens=N, messages=messages)
    assert message.content[0].text == expected
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == N
    with claude.messages.stream(model=model_name, max_tokens=N, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected and final.stop_reason == "max_tokens"

    counted = claude.messages.count_tokens(model=model_name, messages=messages)
    assert counted.input_tokens == message.usage.input_tokens > 0
    assert 0 <= message.usage.cache_read_input_tokens <= message.usage.input_tokens


def test_system_and_multi_turn_messages(stack, model_name, oai, claude):
    """A system prompt and earlier turns reach the template the same way from both APIs."""
    turns = [
        {"role": "user", "content": "Hello, world!"},
        {"role": "assistant", "content": "How are you today?"},
        {"role": "user", "content": QUESTION},
    ]
    system = "You are a small robot."
    chat = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "system", "content": system}, *turns],
        max_tokens=N,
        temperature=0,
    )
    message = claude.messages.create(model=model_name, system=system, messages=turns, max_tokens=N)
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0


def _stop_across_tokens(tokens: list[dict]) -> str:
    """A stop string made of the end of one token's text and the start of the next one's."""
    for a, b in zip(tokens, tokens[1:]):
        if len(a["text"]) >= 2 and b["text"] and "\ufffd" not in a["text"] + b["text"]:
            return a["text"][-2:] + b["text"][:1]
    pytest.fail(f"no two printable neighbouring tokens in {tokens}")


def test_stop_sequences(stack, model_name, oai, llama, claude):
    daemon, _ = stack
    full, tokens = moe_run(daemon.socket, PROMPT, "--raw", max_tokens=2 * N)
    stop = _stop_across_tokens(tokens)
    expected = full[: full.index(stop)]

    done = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=2 * N, temperature=0, stop=[stop, "\x00"]
    )
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "stop"
    chunks = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=2 * N, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected

    answer = llama.generate(
        model=model_name, prompt=PROMPT, raw=True, options={"num_predict": 2 * N, "stop": [stop]}
    )
    assert answer.response == expected and answer.done_reason == "stop"

    chat_full, _ = moe_run(daemon.socket, QUESTION, max_tokens=2 * N)
    chat_stop = chat_full[len(chat_full) // 2 : len(chat_full) // 2 + 2]
    message = claude.messages.create(
        model=model_name,
        max_tokens=2 * N,
        messages=[{"role": "user", "content": QUESTION}],
        stop_sequences=[chat_stop],
    )
    assert message.content[0].text == chat_full[: chat_full.index(chat_stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == chat_stop


def test_logprobs(stack, model_name, oai):
    chat = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 4
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy decoding picks the most likely token.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_concurrent_streaming_chats(stack, model_name, oai):
    """8 streams at once through one gateway (one daemon connection) all finish with the text
    each one gives alone."""
    _, gateway = stack
    prompts = [f"Tell me a story about robot number {i}." for i in range(8)]
    alone = [
        oai.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": p}], max_tokens=N
        )
        .choices[0]
        .message.content
        for p in prompts
    ]

    async def stream_one(client: openai.AsyncOpenAI, prompt: str) -> str:
        parts = []
        stream = await client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=N,
            stream=True,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0
        ) as client:
            return await asyncio.gather(*(stream_one(client, p) for p in prompts))

    assert asyncio.run(all_at_once()) == alone


def test_streams_run_side_by_side_in_the_daemon(stack, model_name, oai):
    """Two open HTTP streams are two active generations in the daemon at once, over the gateway's
    one connection (this chat runs past 3000 tokens on the tiny model: both are still going)."""
    daemon, _ = stack
    streams = [
        oai.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4000,
            stream=True,
        )
        for _ in range(2)
    ]
    try:
        for stream in streams:
            next(iter(stream))
        with daemon.client() as client:
            assert client.status()["active_requests"] == 2
    finally:
        for stream in streams:
            stream.close()


def test_disconnect_cancels_the_daemon_request(stack, model_name, oai):
    daemon, gateway = stack
    with daemon.client() as client:
        before = client.status()
        stream = oai.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4000,
            stream=True,
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # the HTTP connection goes away mid-stream
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = client.status()
            if status["active_requests"] == 0:
                break
            time.sleep(0.05)
        assert status["active_requests"] == 0
        produced = status["tokens_generated"] - before["tokens_generated"]
        assert produced < 4000
        time.sleep(0.3)
        assert client.status()["tokens_generated"] == status["tokens_generated"]
    # The gateway saw no end of the stream: it cancelled it, the model did not stop by itself.
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text)
    }
    cancelled = families["moed_gateway_cancelled_generations"].samples
    assert any(s.labels["api"] == "openai" and s.value >= 1 for s in cancelled)


def test_ollama_keep_alive_unloads_and_the_next_request_reloads(stack, model_name, llama, claude):
    daemon, gateway = stack
    options = {"num_predict": N}
    first = llama.generate(model=model_name, prompt=PROMPT, raw=True, options=options, keep_alive=0)
    with daemon.client() as client:
        deadline = time.monotonic() + 10
        while client.status()["state"] != "idle" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status()["state"] == "idle"
    assert llama.ps().models == []  # released, as ollama shows an unloaded model
    assert httpx.get(f"{gateway.url}/health").json()["status"] == "ready"
    messages = [{"role": "user", "content": QUESTION}]
    assert claude.messages.count_tokens(model=model_name, messages=messages).input_tokens > 0
    again = llama.generate(model=model_name, prompt=PROMPT, raw=True, options=options)
    assert again.response == first.response
    assert [m.model for m in llama.ps().models] == [f"{model_name}:latest"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools_reach_the_chat_template(stack, model_name, oai, claude):
    """Tool specs and earlier tool calls render through the model's template the same way from
    the OpenAI and the Anthropic API (the tiny model's template is tool-aware)."""
    ask = [{"role": "user", "content": QUESTION}]

    def prompt_tokens(**extra) -> int:
        return oai.chat.completions.create(
            model=model_name, messages=extra.pop("messages", ask), max_tokens=1, **extra
        ).usage.prompt_tokens

    plain = prompt_tokens()
    with_tools = prompt_tokens(tools=[WEATHER])
    assert with_tools > plain
    assert prompt_tokens(tools=[WEATHER], tool_choice="none") == plain
    anthropic_tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    counted = claude.messages.count_tokens(model=model_name, messages=ask, tools=[anthropic_tool])
    assert counted.input_tokens == with_tools

    openai_turns = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    anthropic_turns = [
        *ask,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}],
        },
    ]
    followup = prompt_tokens(messages=openai_turns, tools=[WEATHER])
    assert followup > with_tools
    assert (
        claude.messages.count_tokens(
            model=model_name, messages=anthropic_turns, tools=[anthropic_tool]
        ).input_tokens
        == followup
    )
