"""A request that names no token limit runs to the model's end of turn or the end of its context,
in every API, as OpenAI's and ollama's servers run it (not the daemon's default_max_tokens, which
is for `moe run` and the wire), and the cut is said in each API's own words.

The model never ends its turn by itself (tests/fixtures/endless_model.py), so each answer runs
to the end of the context: past the daemon's default of 256 tokens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from moed.daemon.config import ServeConfig
from tests.fixtures.daemon_harness import start_daemon
from tests.fixtures.endless_model import write_endless_checkpoint
from tests.fixtures.gateway_harness import start_gateway

pytestmark = pytest.mark.process

CONTEXT = 320  # max_position_embeddings: room for the daemon's default and more
DEFAULT = ServeConfig().default_max_tokens
MESSAGES = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def endless(checkpoint_factory, tmp_path_factory):
    """(gateway, model name) in front of a daemon on the endless model."""
    source = checkpoint_factory("qwen3_moe", context=CONTEXT)
    tmp = tmp_path_factory.mktemp("endless")
    model = write_endless_checkpoint(source, tmp / "endless_model")
    daemon = start_daemon(tmp / "d", model, "--resident")
    gateway = None
    try:
        gateway = start_gateway(tmp / "g", daemon.socket)
        yield gateway, daemon.client().connect()["model"]["name"]
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop()


def _to_the_end(prompt_tokens: int, completion_tokens: int) -> None:
    assert CONTEXT - prompt_tokens > DEFAULT  # the test means something: past the default
    assert completion_tokens == CONTEXT - prompt_tokens


def test_openai_chat_and_completions_run_to_the_end_of_the_context(endless):
    gateway, name = endless
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    chat = oai.chat.completions.create(model=name, messages=MESSAGES)
    assert chat.choices[0].finish_reason == "length"
    _to_the_end(chat.usage.prompt_tokens, chat.usage.completion_tokens)

    chunks = list(
        oai.chat.completions.create(
            model=name, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length"
    _to_the_end(chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content

    text = oai.completions.create(model=name, prompt="def f")
    assert text.choices[0].finish_reason == "length"
    _to_the_end(text.usage.prompt_tokens, text.usage.completion_tokens)


def test_responses_run_to_the_end_of_the_context(endless):
    gateway, name = endless
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    done = oai.responses.create(model=name, input="Hello!")
    # Cut by the context, said as OpenAI says a cut: incomplete, max_output_tokens.
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    _to_the_end(done.usage.input_tokens, done.usage.output_tokens)


def test_ollama_runs_to_the_end_of_the_context(endless):
    gateway, name = endless
    llama = ollama.Client(host=gateway.url)
    chat = llama.chat(model=name, messages=MESSAGES)
    assert chat.done_reason == "length"
    _to_the_end(chat.prompt_eval_count, chat.eval_count)
    parts = list(llama.generate(model=name, prompt="def f", raw=True, stream=True))
    assert parts[-1].done_reason == "length"
    _to_the_end(parts[-1].prompt_eval_count, parts[-1].eval_count)


def test_anthropic_requires_max_tokens_and_runs_to_it(endless):
    """Anthropic's API has no request without a limit (max_tokens is required there too)."""
    gateway, name = endless
    missing = httpx.post(f"{gateway.url}/v1/messages", json={"model": name, "messages": MESSAGES})
    assert missing.status_code == 400
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    prompt = claude.messages.count_tokens(model=name, messages=MESSAGES).input_tokens
    message = claude.messages.create(model=name, messages=MESSAGES, max_tokens=CONTEXT - prompt)
    assert message.stop_reason == "max_tokens"
    _to_the_end(message.usage.input_tokens, message.usage.output_tokens)


def _readme_block(marker: str) -> str:
    """The README's ```python block that contains `marker`."""
    text = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    return next(b for b in blocks if marker in b)


def test_the_readme_streaming_example_prints_why_it_ended(endless):
    """The example as written (only the gateway's port is this test's): the text, then `[length]`
    on a model that never ends its turn."""
    gateway, _ = endless
    code = _readme_block("from openai import OpenAI").replace("http://127.0.0.1:11435", gateway.url)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    text, _, last = out.stdout.rstrip("\n").rpartition("\n")
    assert last == "[length]" and text
