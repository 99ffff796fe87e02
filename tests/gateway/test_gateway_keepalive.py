"""A long prompt visibly moves through the gateway: before the first token, OpenAI streams get SSE
`: keep-alive` comments and Anthropic streams `ping` events (after each prompt chunk, and on a
timer while one chunk is read), so a client with a read timeout shorter than the prompt keeps
waiting. Real daemon (its prompt layers slowed), real gateway, plain HTTP."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from moed.gateway.generation import KEEPALIVE_S
from tests.fixtures.daemon_harness import start_daemon
from tests.fixtures.gateway_harness import start_gateway

pytestmark = pytest.mark.process

# Each of the tiny checkpoint's two layers of a prompt chunk sleeps this long: one chunk takes
# longer than READ_TIMEOUT_S, and no gap between keep-alives comes near it.
LAYER_DELAY_MS = 4000
READ_TIMEOUT_S = KEEPALIVE_S + 2.0
MESSAGES = [{"role": "user", "content": "a prompt read slowly"}]


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("keepalive")
    env = {"MOED_DEBUG_FAULTS": f"layer_delay_ms={LAYER_DELAY_MS}"}
    # Every test sends the same prompt: with the prefix cache on, only the first would read it.
    daemon = start_daemon(tmp / "d", tiny_model, "--resident", "--prefix-cache", "0", env=env)
    gateway = None
    try:
        gateway = start_gateway(tmp / "g", daemon.socket)
        yield daemon, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop()


def _lines_until_text(url: str, body: dict, is_text) -> tuple[list[str], list[str]]:
    """The SSE lines before the first one carrying text, and the rest; the read timeout is
    shorter than the prompt takes."""
    timeout = httpx.Timeout(30.0, read=READ_TIMEOUT_S)
    before, after = [], []
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        assert r.status_code == 200
        for line in filter(None, r.iter_lines()):  # blank lines end SSE events
            (after if after or is_text(line) else before).append(line)
    return before, after


def _has_content(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
    return bool(delta.get("content"))


def _has_text(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    data = json.loads(line[len("data: ") :])
    return data["type"] == "content_block_delta" and bool(data["delta"].get("text"))


def test_openai_stream_sends_keepalive_comments_while_the_prompt_is_read(slow_stack):
    _, gateway = slow_stack
    body = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
    before, after = _lines_until_text(f"{gateway.url}/v1/chat/completions", body, _has_content)
    # One at admission, one per chunk read, at least one on the timer while the chunk was read.
    assert before.count(": keep-alive") >= 3, before
    assert ": keep-alive" not in after and after[-1] == "data: [DONE]"


def test_anthropic_stream_sends_pings_while_the_prompt_is_read(slow_stack, tiny_model):
    _, gateway = slow_stack
    body = {"model": tiny_model.name, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    before, after = _lines_until_text(f"{gateway.url}/v1/messages", body, _has_text)
    # The opening ping, then as for OpenAI.
    assert before.count("event: ping") >= 4, before
    assert after[-1].startswith("data:") and "message_stop" in after[-1]


def test_a_client_leaving_during_the_keepalives_cancels_the_generation(slow_stack):
    daemon, gateway = slow_stack
    # Uncancelled, it would decode to the end of the model's context: max_tokens is all the room
    # the prompt leaves (more is a 400 before anything starts, and nothing to cancel).
    with daemon.client() as c:
        limits = c.connect()["limits"]
    counted = httpx.post(
        f"{gateway.url}/v1/messages/count_tokens",
        json={"model": "any", "messages": MESSAGES},
        timeout=30,
    )
    room = limits["context_tokens"] - counted.json()["input_tokens"]
    body = {"messages": MESSAGES, "max_tokens": min(room, limits["max_tokens"]), "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == ": keep-alive":
                break  # the client goes away before the first token
    with daemon.client() as c:
        while c.status()["active_requests"]:  # the gateway's cancel reaches the daemon
            time.sleep(0.1)
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert 'moed_gateway_cancelled_generations_total{api="openai"} 1.0' in metrics


def test_a_client_leaving_before_its_answer_starts_cancels_and_is_counted(slow_stack, tiny_model):
    """While one prompt's chunk holds the engine, a second request waits for its first event with
    no response started; its client leaving then cancels it in the daemon, and it is counted."""
    daemon, gateway = slow_stack
    body = {"model": tiny_model.name, "messages": MESSAGES, "max_tokens": 1, "stream": True}
    url = f"{gateway.url}/v1/messages"
    with httpx.stream("POST", url, json=body, timeout=30) as first:
        assert first.status_code == 200  # taken: its prompt chunk now holds the engine
        with pytest.raises(httpx.ReadTimeout):  # no answer started within a second: it leaves
            httpx.post(url, json=body, timeout=httpx.Timeout(30.0, read=1.0))
        lines = list(filter(None, first.iter_lines()))
    assert "message_stop" in lines[-1]  # the first one ran to its end
    with daemon.client() as c:
        while c.status()["active_requests"]:
            time.sleep(0.1)
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert 'moed_gateway_cancelled_generations_total{api="anthropic"} 1.0' in metrics
