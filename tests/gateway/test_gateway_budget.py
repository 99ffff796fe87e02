"""Each API's metadata and its answer to a request over the context, through a real daemon (the
tiny checkpoint's context is 4096 tokens; the stack's prompt limit is 512): the context length
where clients look for it, and a 400 in the API's own words instead of a silent cap or a 413."""

from __future__ import annotations

import re
import time

import anthropic
import httpx
import ollama
import openai
import pytest

from moed.daemon.config import ServeConfig
from moed.daemon.model.limits import UNKNOWN_CONTEXT_MAX_TOKENS, limits_for
from moed.gateway import anthropic_api, openai_api
from moed.gateway.anthropic_budget import budget_message
from moed.gateway.token_budget import BudgetError, Overrun
from moed.protocol.model_config import ModelConfig

CONTEXT = 4096  # max_position_embeddings of tests/fixtures' qwen3_moe


@pytest.fixture(scope="module")
def stack(gateway_stack):
    daemon, gateway = gateway_stack
    name = daemon.client().connect()["model"]["name"]
    return gateway, name


@pytest.mark.process
def test_the_context_length_is_in_models_and_show(stack):
    gateway, name = stack
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    entry = oai.models.list().data[0].model_dump()
    assert entry["context_length"] == entry["max_model_len"] == CONTEXT
    assert oai.models.retrieve(name).model_dump()["context_length"] == CONTEXT
    shown = ollama.Client(host=gateway.url).show(name)
    assert shown.modelinfo["qwen3_moe.context_length"] == CONTEXT


@pytest.mark.process
def test_max_tokens_past_the_context_is_a_400_in_each_api(stack):
    gateway, name = stack
    messages = [{"role": "user", "content": "Hello!"}]
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat:
        oai.chat.completions.create(model=name, messages=messages, max_tokens=CONTEXT)
    assert chat.value.code == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in chat.value.message

    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as message:
        claude.messages.create(model=name, messages=messages, max_tokens=CONTEXT)
    prompt = claude.messages.count_tokens(model=name, messages=messages).input_tokens
    expected = f"exceed context limit: {prompt} + {CONTEXT} > {CONTEXT}"
    assert expected in message.value.body["error"]["message"]

    with pytest.raises(ollama.ResponseError) as chat_ollama:
        ollama.Client(host=gateway.url).chat(
            model=name, messages=messages, options={"num_predict": CONTEXT}
        )
    assert chat_ollama.value.status_code == 400 and str(CONTEXT) in chat_ollama.value.error


@pytest.mark.process
def test_anthropic_reports_input_tokens_first_and_folds_system_entries(stack):
    """message_start carries the prompt's tokens (counted before the first event); a `system`
    entry inside `messages` reads as the same prompt as top-level system blocks."""
    gateway, name = stack
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    turns = [{"role": "user", "content": "Hello!"}]
    system = [
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be kind."},
    ]
    with claude.messages.stream(
        model=name,
        system=system,
        messages=turns,
        max_tokens=6,
        thinking={"type": "adaptive"},
        metadata={"user_id": "u"},
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "high"}},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    counted = claude.messages.count_tokens(model=name, system=system, messages=turns)
    assert start.message.usage.input_tokens == counted.input_tokens == final.usage.input_tokens

    folded = httpx.post(
        f"{gateway.url}/v1/messages?beta=true",
        json={
            "model": name,
            "max_tokens": 6,
            "system": [system[0]],
            "messages": [*turns, {"role": "system", "content": "Be kind."}],
        },
    )
    assert folded.status_code == 200, folded.text
    assert folded.json()["content"][0]["text"] == final.content[0].text
    assert folded.json()["usage"]["input_tokens"] == counted.input_tokens


def _unload(daemon, gateway, name) -> None:
    """The model unloaded as after an idle keep-alive (an Ollama request with keep_alive 0)."""
    llama = ollama.Client(host=gateway.url)
    llama.generate(model=name, prompt="Hi", raw=True, options={"num_predict": 1}, keep_alive=0)
    with daemon.client() as client:
        deadline = time.monotonic() + 10
        while client.status()["state"] != "idle" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status()["state"] == "idle"


@pytest.mark.process
def test_while_the_model_loads_the_budget_is_still_checked_before_the_answer(gateway_stack):
    """The daemon checks a request's budget once the model is loaded; a request that finds it
    unloaded is counted by the gateway first, so it is still a 400 (not an error inside a started
    stream), and message_start still carries the prompt's tokens."""
    daemon, gateway = gateway_stack
    name = daemon.client().connect()["model"]["name"]
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello!"}]
    prompt = claude.messages.count_tokens(model=name, messages=messages).input_tokens

    _unload(daemon, gateway, name)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=name, messages=messages, max_tokens=CONTEXT)
    assert f"exceed context limit: {prompt} + {CONTEXT} > {CONTEXT}" in str(refused.value)

    _unload(daemon, gateway, name)
    with claude.messages.stream(model=name, messages=messages, max_tokens=3) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == prompt


@pytest.mark.process
def test_what_cannot_be_honoured_is_refused(stack):
    gateway, name = stack
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    turns = [{"role": "user", "content": "Hello!"}]
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        claude.messages.create(model=name, messages=turns, max_tokens=4, extra_body={"top_k": 5})
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        claude.messages.create(
            model=name,
            messages=turns,
            max_tokens=4,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": {}}}},
        )


def test_a_max_tokens_over_the_daemons_limit_is_named_in_each_apis_words():
    err = BudgetError(Overrun.MAX_TOKENS, 10, 32000, 8192)
    assert err.status == 400
    assert anthropic_api.error_body(err)["error"]["message"].startswith("max_tokens: 32000 > 8192")
    body = openai_api.error_body(err)["error"]
    assert body["param"] == "max_tokens" and "at most 8192 completion tokens" in body["message"]


CLAUDE_CODE_RETRY = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)  # the only refusal Claude Code 2.1.197 parses to retry (with C - P - 1000, at least 3000)


def test_a_max_tokens_claude_code_can_retry_is_said_as_the_overflow_it_parses():
    """Over a limit that is the context (the default): the overflow, whose retry fits. Where no
    retry fits (a limit under the context, a context too small), the client setting is named."""
    over_context = BudgetError(Overrun.MAX_TOKENS, 800, 32000, 16384)
    said = budget_message(over_context, "m", context=16384)
    found = CLAUDE_CODE_RETRY.match(said)
    assert found and found.groups() == ("800", "32000", "16384")
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in said  # it retries by itself
    capped = budget_message(BudgetError(Overrun.MAX_TOKENS, 800, 32000, 4096), "m", 16384)
    assert capped.startswith(
        "max_tokens: 32000 > 4096, which is the maximum allowed number of output tokens for m"
    )
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS to 4096" in capped and not CLAUDE_CODE_RETRY.search(
        capped
    )
    tight = budget_message(BudgetError(Overrun.CONTEXT, 3000, 32000, 4096), "m")
    assert CLAUDE_CODE_RETRY.match(tight) and "CLAUDE_CODE_MAX_OUTPUT_TOKENS to 1096" in tight


@pytest.mark.process
def test_the_anthropic_model_list_carries_its_own_limit_fields(stack):
    """The anthropic SDK's models.list() and retrieve() (it sends anthropic-version): Anthropic's
    ModelInfo with max_input_tokens (the prompt limit, 512 here) and max_tokens (the context)."""
    gateway, name = stack
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    listed = claude.models.list().data
    assert listed[0].id == name and "demo" in [m.id for m in listed]  # every servable model
    assert (listed[0].max_input_tokens, listed[0].max_tokens) == (512, CONTEXT)
    one = claude.models.retrieve(name)
    assert one.type == "model" and (one.max_input_tokens, one.max_tokens) == (512, CONTEXT)
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.models.retrieve("no-such-model")
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_max_tokens_limit_defaults_to_the_models_context():
    long = ModelConfig.from_dict({"max_position_embeddings": 131072})
    assert limits_for(ServeConfig(), long).max_tokens == 131072
    assert limits_for(ServeConfig(), ModelConfig.from_dict({})).max_tokens == (
        UNKNOWN_CONTEXT_MAX_TOKENS
    )
    capped = ServeConfig(max_tokens_limit=100)
    assert limits_for(capped, long).max_tokens == 100
