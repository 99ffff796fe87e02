"""The gateway under hostile input, written as the attacks (issue 23): a real daemon, a real
`moed gateway` process, real sockets. After each attack `/health` is 200 and another client is
served."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import httpx
import msgpack
import pytest
import zmq

from moed.client import RequestFailed
from moed.gateway.errors import STATUS, ErrorKind, from_client_error
from moed.protocol import RETRYABLE, ErrorCode
from tests.fixtures.daemon_harness import start_daemon
from tests.fixtures.gateway_harness import gateway_command, start_gateway


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model):
    d = start_daemon(tmp_path_factory.mktemp("hostile-gw"), tiny_model, "--resident")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def gateway(daemon, tmp_path_factory):
    g = start_gateway(tmp_path_factory.mktemp("gw"), daemon.socket)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def model_name(daemon) -> str:
    with daemon.client() as c:
        return c.connect()["model"]["name"]


def _served(url: str, model: str) -> None:
    """/health is 200 and a plain completion is answered: the attack took nothing from others."""
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    done = httpx.post(
        f"{url}/v1/completions", json={"model": model, "prompt": "The", "max_tokens": 2}, timeout=60
    )
    assert done.status_code == 200, done.text


def _deep_schema(levels: int) -> dict:
    """A JSON schema whose maps nest `levels` deep (an object and its properties: two a step)."""
    schema: dict = {"type": "string"}
    for _ in range(levels // 2):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.process
def test_refused_frames_name_their_request(daemon):
    """A frame refused before decoding (nested too deep, over the frame limit) is answered with
    its own id, so a client that multiplexes requests can route the error."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{daemon.socket}")
    try:
        deep: list = []
        for _ in range(100):
            deep = [deep]
        frames = {
            "deep-1": {"v": 1, "type": "generate", "id": "deep-1", "prompt": "hi", "x": deep},
            "big-2": {"v": 1, "type": "generate", "id": "big-2", "prompt": "x" * 5_000_000},
        }
        for request_id, msg in frames.items():
            sock.send(msgpack.packb(msg))
            assert sock.poll(10_000), "no answer"
            reply = msgpack.unpackb(sock.recv())
            assert reply["type"] == "error" and reply["id"] == request_id, reply
        assert reply["code"] == "frame_too_large"
    finally:
        sock.close()
    with daemon.client() as c:
        assert c.status()["state"] == "ready"


@pytest.mark.process
def test_hung_up_requests_with_deep_tool_schemas_leave_the_gateway_serving(gateway, model_name):
    """66 chats carrying a legal tool schema nested 20 deep, whose clients hang up at once: once
    they are gone /health is 200 and others are served; a schema nested past the daemon's limit
    is a 400 in each API's shape, not a request that never ends."""
    body = json.dumps(_chat(model_name, max_tokens=2, tools=[_tool(_deep_schema(20))])).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    for _ in range(66):
        with socket.create_connection(("127.0.0.1", gateway.port)) as s:
            s.sendall(request)  # and hang up without reading
    deadline = time.monotonic() + 120
    while httpx.get(f"{gateway.url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "/health never came back"
        time.sleep(0.2)
    _served(gateway.url, model_name)

    # A legal schema is served, not refused.
    fine = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=_chat(model_name, max_tokens=2, tools=[_tool(_deep_schema(20))]),
        timeout=60,
    )
    assert fine.status_code == 200, fine.text
    too_deep = _tool(_deep_schema(40))
    for path, body, shape in [
        ("/v1/chat/completions", _chat(model_name, tools=[too_deep]), "openai"),
        (
            "/v1/messages",
            {
                **_chat(model_name, max_tokens=2),
                "tools": [{"name": "f", "input_schema": _deep_schema(40)}],
            },
            "anthropic",
        ),
        ("/api/chat", _chat(model_name, tools=[too_deep], stream=False), "ollama"),
    ]:
        reply = httpx.post(f"{gateway.url}{path}", json=body, timeout=60)
        assert reply.status_code == 400, (path, reply.text)
        _assert_shape(reply.json(), shape, "deeper")
    _served(gateway.url, model_name)


@pytest.mark.process
def test_a_body_that_grows_past_the_frame_limit_when_encoded_is_413(gateway, model_name):
    """3.6 MiB of floats in `tools` pass the 4 MiB body cap but take twice that as msgpack."""
    floats = [0.5] * 900_000  # "0.5," is 4 bytes of JSON, 9 of msgpack
    for path, body, shape in [
        ("/v1/chat/completions", _chat(model_name, tools=[_tool({"enum": floats})]), "openai"),
        (
            "/v1/messages",
            {
                **_chat(model_name, max_tokens=2),
                "tools": [{"name": "f", "input_schema": {"enum": floats}}],
            },
            "anthropic",
        ),
        ("/api/chat", _chat(model_name, tools=[_tool({"enum": floats})]), "ollama"),
    ]:
        raw = json.dumps(body, separators=(",", ":")).encode()
        assert len(raw) < 4 * 1024 * 1024
        reply = httpx.post(
            f"{gateway.url}{path}",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert reply.status_code == 413, (path, reply.text)
        _assert_shape(reply.json(), shape, "encoded")
    _served(gateway.url, model_name)


HUGE = 10**30
HOSTILE_BODIES = [
    ("/v1/completions", {"prompt": "x", "seed": HUGE}, "openai"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "openai"),
    ("/v1/completions", {"prompt": "x", "max_tokens": HUGE}, "openai"),
    ("/v1/completions", {"prompt": [HUGE, 1]}, "openai"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": HUGE}, "openai"),
    ("/v1/chat/completions", {"max_tokens": 2**64}, "openai"),
    ("/v1/messages", {"max_tokens": HUGE}, "anthropic"),
    ("/api/generate", {"prompt": "x", "options": {"num_predict": HUGE}}, "ollama"),
    ("/api/generate", {"prompt": "x", "keep_alive": HUGE}, "ollama"),
    ("/api/generate", {"prompt": "x", "options": {"seed": 2**64}}, "ollama"),
    ("/api/chat", {"logprobs": True, "top_logprobs": HUGE}, "ollama"),
]


@pytest.mark.process
def test_integers_out_of_range_are_400_in_each_apis_shape(gateway, model_name):
    for path, fields, shape in HOSTILE_BODIES:
        body = {"model": model_name, **fields}
        if "prompt" not in fields:
            body["messages"] = [{"role": "user", "content": "hi"}]
        if path == "/v1/messages":
            body.setdefault("max_tokens", 2)
        reply = httpx.post(f"{gateway.url}{path}", json=body, timeout=60)
        assert reply.status_code == 400, (path, fields, reply.text)
        _assert_shape(reply.json(), shape, "range")
    _served(gateway.url, model_name)


@pytest.mark.process
def test_lone_surrogates_and_deep_json_are_400(gateway, model_name):
    surrogate = (
        b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
        % model_name.encode()
    )
    deep = b"[" * 100_000 + b"]" * 100_000
    for path, shape in [
        ("/v1/chat/completions", "openai"),
        ("/v1/messages", "anthropic"),
        ("/api/chat", "ollama"),
    ]:
        for raw, words in [(surrogate, "surrogate"), (deep, "deeper")]:
            reply = httpx.post(
                f"{gateway.url}{path}",
                content=raw,
                headers={"content-type": "application/json"},
                timeout=60,
            )
            assert reply.status_code == 400, (path, reply.text)
            _assert_shape(reply.json(), shape, words)
    _served(gateway.url, model_name)


def _tricklers(port: int, count: int) -> list[socket.socket]:
    """`count` connections that sent part of their headers and then a byte more (slowloris)."""
    tricklers = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        tricklers.append(s)
    for s in tricklers:
        s.sendall(b"a")
    return tricklers


def _closed_by_server(tricklers: list[socket.socket]) -> None:
    """Every trickler is closed by the server: at the header deadline, or to make room."""
    for s in tricklers:
        s.settimeout(60)
        answer = b""
        while chunk := _recv(s):
            answer += chunk
        assert answer in (b"", *_TIMEOUT_ANSWERS), answer


@pytest.mark.process
def test_trickled_headers_do_not_starve_health(gateway, model_name):
    """70 connections sending their headers a byte at a time: /health and a real request are still
    served, and each trickler is cut off at the header deadline."""
    tricklers = _tricklers(gateway.port, 70)
    try:
        _served(gateway.url, model_name)
        _closed_by_server(tricklers)
        _served(gateway.url, model_name)
    finally:
        for s in tricklers:
            s.close()


@pytest.mark.process
def test_trickled_bodies_are_cut_off_and_free_their_slots(daemon, model_name, tmp_path):
    """Requests whose bodies stall after the first bytes take this client's whole share of the
    API (48 in flight; the next is a 429): /health still answers, and at the body timeout each is
    answered 408 and closed, so the API serves again."""
    gateway = start_gateway(tmp_path, daemon.socket, "--body-timeout", "5")
    stalled = []
    try:
        for _ in range(48):
            s = socket.create_connection(("127.0.0.1", gateway.port))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"prompt": '
            )
            stalled.append(s)
        deadline = time.monotonic() + 60
        while True:  # once all 48 are in flight the next is a 429 (before that, a quick 400)
            more = httpx.post(f"{gateway.url}/v1/completions", json={}, timeout=30)
            if more.status_code == 429:
                break
            assert more.status_code == 400 and time.monotonic() < deadline, more.text
        assert more.headers["retry-after"] and "in flight" in more.json()["error"]["message"]
        assert httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200
        for s in stalled:
            s.settimeout(60)
            answer = b""
            while chunk := _recv(s):
                answer += chunk
            assert answer in _TIMEOUT_ANSWERS, answer
        _served(gateway.url, model_name)
    finally:
        for s in stalled:
            s.close()
        gateway.stop()


@pytest.mark.process
def test_headers_past_the_size_limit_are_431(gateway, model_name):
    with socket.create_connection(("127.0.0.1", gateway.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000)
        s.settimeout(60)
        answer = b""
        while chunk := _recv(s):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    _served(gateway.url, model_name)


@pytest.mark.process
def test_at_the_connection_cap_idle_connections_make_room(daemon, model_name, tmp_path):
    """More tricklers than the gateway keeps sockets open: the oldest idle one is closed for each
    new connection, so a real client still gets in."""
    gateway = start_gateway(
        tmp_path, daemon.socket, "--max-open-connections", "32", "--max-connections", "8"
    )
    tricklers = []
    try:
        tricklers = _tricklers(gateway.port, 70)
        _served(gateway.url, model_name)
        _closed_by_server(tricklers)
        _served(gateway.url, model_name)
    finally:
        for s in tricklers:
            s.close()
        gateway.stop()


_TIMEOUT_ANSWERS = (
    b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
)


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(4096)
    except ConnectionResetError:
        return b""


@pytest.mark.process
def test_a_request_the_daemon_does_not_answer_gets_504_by_the_deadline(
    daemon, model_name, tmp_path
):
    """The daemon frozen (SIGSTOP) under a request: the gateway answers 504 in the API's shape at
    its deadline instead of waiting; once the daemon runs again everyone is served."""
    gateway = start_gateway(tmp_path, daemon.socket, "--answer-timeout", "1")
    try:
        _served(gateway.url, model_name)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            for path, body, shape in [
                ("/v1/completions", {"model": model_name, "prompt": "x"}, "openai"),
                ("/v1/messages", {**_chat(model_name), "max_tokens": 2}, "anthropic"),
                ("/api/generate", {"model": model_name, "prompt": "x"}, "ollama"),
            ]:
                reply = httpx.post(f"{gateway.url}{path}", json=body, timeout=60)
                assert reply.status_code in (503, 504), (path, reply.text)
                assert reply.headers["retry-after"]
                _assert_shape(reply.json(), shape, "")
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while httpx.get(f"{gateway.url}/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        _served(gateway.url, model_name)
    finally:
        gateway.stop()


@pytest.mark.process
def test_limits_that_leave_no_room_for_health_are_refused(tmp_path):
    out = subprocess.run(
        gateway_command(tmp_path / "d.sock", 0, "--max-open-connections", "10"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "room for /health" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_every_daemon_error_code_has_a_status():
    """No daemon error falls through to a bare 500; the retryable ones are 503 (or 429) with a
    Retry-After."""
    for code in ErrorCode:
        err = from_client_error(RequestFailed(code, "x", code in RETRYABLE))
        if code in (ErrorCode.INTERNAL, ErrorCode.BAD_FRAME, ErrorCode.UNKNOWN_TYPE):
            continue  # the gateway's own fault: a 500 is the truth
        if code in (ErrorCode.UNSUPPORTED_VERSION, ErrorCode.DUPLICATE_ID):
            continue
        assert err.kind is not ErrorKind.INTERNAL, code
        if code in RETRYABLE:
            assert STATUS[err.kind] in (429, 503) and err.headers()["Retry-After"], code
    for code in (ErrorCode.RANK_FAILED, ErrorCode.ENGINE_STALLED, ErrorCode.SLOW_CONSUMER):
        err = from_client_error(RequestFailed(code, "x", True))
        assert err.status == 503 and err.code == code.value


def _assert_shape(body: dict, shape: str, words: str) -> None:
    if shape == "openai":
        message = body["error"]["message"]
        assert body["error"]["type"]
    elif shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"]
        message = body["error"]["message"]
    else:
        message = body["error"]
    assert isinstance(message, str) and words in message, body
