"""The gateway's HTTP edges against a real daemon: /health and /metrics read by real parsers, the
API key, and bad input answered in each API's own error shape and status."""

from __future__ import annotations

import subprocess
import sys

import anthropic
import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.gateway_harness import free_port, gateway_command, start_gateway


@pytest.fixture(scope="module")
def stack(gateway_stack):
    return gateway_stack


@pytest.mark.process
def test_health_is_json_and_ready(stack):
    daemon, gateway = stack
    response = httpx.get(f"{gateway.url}/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ready"
    assert body["daemon"]["pid"] == daemon.proc.pid


@pytest.mark.process
def test_metrics_hold_daemon_and_gateway_series(stack):
    _, gateway = stack
    httpx.get(f"{gateway.url}/v1/models")
    text = httpx.get(f"{gateway.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["moed_gateway_daemon_up"].samples[0].value == 1
    daemon_series = [n for n in families if n.startswith("moed_") and "gateway" not in n]
    assert daemon_series, "the daemon's own counters are missing"
    requests = families["moed_gateway_requests"]
    assert any(
        s.labels == {"api": "openai", "endpoint": "/v1/models", "status": "200"} and s.value >= 1
        for s in requests.samples
    )
    latency = families["moed_gateway_request_duration_seconds"]
    assert latency.type == "histogram"
    assert any(s.name.endswith("_bucket") for s in latency.samples)


@pytest.mark.process
def test_model_listings(stack):
    daemon, gateway = stack
    name = daemon.client().connect()["model"]["name"]
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    listed = {m.id: m for m in oai.models.list()}
    assert list(listed)[0] == name  # the started model first, then every servable one
    assert listed["demo"].model_extra["context_length"] > 0  # servable, not loaded
    assert oai.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("not-" + name)
    assert httpx.get(gateway.url).text == "moed gateway is running"
    llama = ollama.Client(host=gateway.url)
    tags = [m.model for m in llama.list().models]
    assert tags[0] == f"{name}:latest" and "demo:latest" in tags
    assert [m.model for m in llama.ps().models] == [f"{name}:latest"]  # only the loaded one
    assert llama.show(f"{name}:latest").details.family == "qwen3_moe"
    assert httpx.get(f"{gateway.url}/api/version").json()["version"]


@pytest.mark.process
def test_malformed_json_gets_each_apis_error_shape(stack):
    _, gateway = stack
    bad = b'{"model": "m", "messages": ['
    openai_error = httpx.post(f"{gateway.url}/v1/chat/completions", content=bad)
    assert openai_error.status_code == 400
    assert openai_error.json()["error"]["type"] == "invalid_request_error"
    anthropic_error = httpx.post(f"{gateway.url}/v1/messages", content=bad)
    assert anthropic_error.status_code == 400
    body = anthropic_error.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    ollama_error = httpx.post(f"{gateway.url}/api/chat", content=bad)
    assert ollama_error.status_code == 400 and isinstance(ollama_error.json()["error"], str)


@pytest.mark.process
def test_wrong_types_through_the_sdks(stack):
    daemon, gateway = stack
    name = daemon.client().connect()["model"]["name"]
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens="many"
        )
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=name, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="hi", max_tokens=2)

    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=name, max_tokens=4, messages=[{"role": "user", "content": 42}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"

    llama = ollama.Client(host=gateway.url)
    with pytest.raises(ollama.ResponseError) as failed:
        llama.generate(model=name, prompt="hi", options={"num_predict": "lots"})
    assert failed.value.status_code == 400


@pytest.mark.process
def test_too_long_prompt_is_400_context_length_exceeded(stack):
    """A prompt over the daemon's limit (512 tokens here) is OpenAI's 400 context_length_exceeded
    (not 413, which clients read as a body too large), with or without max_tokens."""
    daemon, gateway = stack
    name = daemon.client().connect()["model"]["name"]
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    for extra in ({"max_tokens": 2}, {}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model=name, prompt=[5] * 600, **extra)
        assert err.value.code == "context_length_exceeded"


@pytest.mark.process
def test_off_loopback_needs_an_api_key(stack):
    daemon, _ = stack
    refused = subprocess.run(
        gateway_command(daemon.socket, free_port(), "--host", "0.0.0.0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--api-key-file" in refused.stderr


@pytest.mark.process
def test_api_key_is_enforced(stack, tmp_path):
    daemon, _ = stack
    key = "k" * 12 + "-secret-" + "z" * 12
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    gateway = start_gateway(
        tmp_path,
        daemon.socket,
        "--api-key-file",
        str(key_file),
        "--max-body-bytes",
        "4096",
        "--cors-origin",
        "http://chat.localhost",
    )
    try:
        url = gateway.url
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).models.list()
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
            )
        with pytest.raises(ollama.ResponseError) as denied:
            ollama.Client(host=url).list()
        assert denied.value.status_code == 401
        authorized = ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"})
        assert authorized.list().models
        assert httpx.get(f"{url}/metrics").status_code == 401
        # A web chat UI's preflight carries no key; the real request does.
        origin = {"Origin": "http://chat.localhost"}
        preflight = httpx.options(
            f"{url}/v1/chat/completions",
            headers={**origin, "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://chat.localhost"
        listed = httpx.get(f"{url}/v1/models", headers={**origin, "x-api-key": key})
        assert listed.headers["access-control-allow-origin"] == "http://chat.localhost"
        # The body limit, with a Content-Length and chunked (no length given up front).
        big = {"model": "m", "prompt": "x" * 5000}
        headers = {"Authorization": f"Bearer {key}"}
        too_big = httpx.post(f"{url}/v1/completions", json=big, headers=headers)
        assert too_big.status_code == 413 and "error" in too_big.json()
        chunks = (part for part in [b'{"model": "m", "prompt": "', b"x" * 5000, b'"}'])
        chunked = httpx.post(f"{url}/api/generate", content=chunks, headers=headers)
        assert chunked.status_code == 413 and isinstance(chunked.json()["error"], str)
    finally:
        gateway.stop()


@pytest.mark.process
def test_gateway_imports_no_mlx():
    probe = (
        "import sys, moed.gateway.app, moed.gateway.cli, moed.client.async_client; "
        "print('mlx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_streamed_chunk_is_the_same_bytes_as_the_whole_object_encoded():
    from moed.gateway.openai_api import ChunkFrame, sse

    envelope = {"id": "cmpl-1", "created": 5, "model": 'm\u00e9"x', "object": "text_completion"}
    entry = {"index": 0, "text": 'h\u00e9\n"\u2028', "logprobs": None, "finish_reason": None}
    for include_usage in (True, False):
        usage_null = {"usage": None} if include_usage else {}
        expected = sse({**envelope, "choices": [entry], **usage_null})
        assert ChunkFrame(envelope, include_usage)(entry) == expected
