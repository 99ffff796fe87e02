"""Bad input never kills the daemon: every case gets a typed error (or a bad_frame) and it keeps
serving."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

from moed.client import RequestFailed
from tests.fixtures.daemon_harness import (
    run_captured,
    serve_command,
    short_socket_path,
    start_daemon,
)

pytestmark = pytest.mark.process

SPEC = Path(__file__).parents[2] / "protocol" / "PROTOCOL.md"


@pytest.fixture
def raw_socket(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{daemon.socket}")
    yield sock
    sock.close()


def exchange(sock, frame: bytes | list[bytes], timeout_ms: int = 5000) -> dict | None:
    if isinstance(frame, list):
        sock.send_multipart(frame)
    else:
        sock.send(frame)
    if not sock.poll(timeout_ms):
        return None
    return msgpack.unpackb(sock.recv())


CASES = [
    (b"\xc1 not msgpack", "bad_frame"),
    (msgpack.packb([1, 2, 3]), "bad_frame"),
    (msgpack.packb({"v": 1, "type": "generate", "id": 1}), "invalid_request"),
    (msgpack.packb({"v": 1, "type": "generate", "id": 2, "prompt": 42}), "invalid_request"),
    (
        msgpack.packb({"v": 1, "type": "generate", "id": 3, "prompt": "a", "max_tokens": "many"}),
        "invalid_request",
    ),
    (msgpack.packb({"v": 1, "type": "teleport", "id": 4}), "unknown_type"),
    (msgpack.packb({"v": 99, "type": "hello", "id": 5}), "unsupported_version"),
    (
        msgpack.packb({"v": 1, "type": "generate", "id": 6, "prompt": "a" * 2_000_000}),
        "prompt_too_long",
    ),
    (
        msgpack.packb({"v": 1, "type": "generate", "id": 7, "prompt_ids": [1] * 40_000}),
        "prompt_too_long",
    ),
    (
        msgpack.packb({"v": 1, "type": "generate", "id": 8, "prompt": "x" * 5_000_000}),
        "frame_too_large",
    ),
    (
        msgpack.packb(
            {"v": 1, "type": "generate", "id": 9, "prompt": "a", "model": "/no/such/model"}
        ),
        "model_not_found",
    ),
    (msgpack.packb(msgpack.ExtType(3, b"boom")), "bad_frame"),
]


@pytest.mark.parametrize("frame,code", CASES, ids=[c for _, c in CASES])
def test_bad_input_gets_typed_error_and_daemon_keeps_serving(daemon, raw_socket, frame, code):
    reply = exchange(raw_socket, frame)
    assert reply is not None, "no answer"
    assert reply["type"] == "error" and reply["code"] == code, reply
    assert isinstance(reply["message"], str) and reply["message"]
    with daemon.client() as c:
        assert c.status()["state"] == "ready"
    assert daemon.proc.poll() is None


def test_tokenized_prompt_over_limit_is_refused(daemon_factory, tiny_model, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[serve]\nmax_prompt_tokens = 8\n")
    d = daemon_factory(tiny_model, "--resident", "--config", str(cfg))
    with d.client() as c:
        with pytest.raises(RequestFailed) as info:
            list(c.generate("word " * 50, raw=True))
        assert info.value.code.value == "prompt_too_long"
        assert c.status()["state"] == "ready"


def test_multi_frame_and_garbage_storm_then_generate(daemon, raw_socket):
    raw_socket.send_multipart([b"a", b"b", b"c"])  # not one message per frame: dropped
    for n in range(200):
        raw_socket.send(bytes([n % 256]) * (n + 1))
    for _ in range(200):
        assert raw_socket.poll(5000)
        raw_socket.recv()
    with daemon.client() as c:
        text = "".join(
            e.text for e in c.generate("hi", max_tokens=4, raw=True) if hasattr(e, "text")
        )
    assert isinstance(text, str)


def test_duplicate_request_id_is_refused(daemon, raw_socket):
    gen = {
        "v": 1,
        "type": "generate",
        "id": "dup",
        "prompt": "hello",
        "max_tokens": 4000,
        "raw": True,
    }
    raw_socket.send(msgpack.packb(gen))
    raw_socket.send(msgpack.packb(gen))
    errors = []
    while raw_socket.poll(10000):
        msg = msgpack.unpackb(raw_socket.recv())
        if msg["type"] == "error":
            errors.append(msg)
            raw_socket.send(msgpack.packb({"v": 1, "type": "cancel", "id": "c", "target": "dup"}))
        if msg["type"] == "done":
            break
    # Not the running stream's end for a client routing by id: `id` is nil, the id is in `target`.
    assert [(e["code"], e["id"], e["target"]) for e in errors] == [("duplicate_id", None, "dup")]
    assert msg["type"] == "done" and msg["finish_reason"] == "cancelled"


def test_spec_minimal_python_client_runs(daemon):
    code = re.search(r"```python\n(.*?)\n```", SPEC.read_text(), re.S).group(1)
    code = code.replace("ipc:///tmp/moed-501/moed.sock", f"ipc://{daemon.socket}")
    code = code.replace('"prompt": "Hello"', '"prompt": "Hello", "max_tokens": 5')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "'type': 'done'" in out.stdout


def test_unknown_model_path_fails_serve_clearly(tmp_path):
    out = run_captured(serve_command("/no/such/model", short_socket_path(), tmp_path), timeout=60)
    assert out.returncode == 3
    assert "does not exist" in out.stderr


def test_malformed_setting_is_a_config_error(tmp_path, tiny_model):
    out = run_captured(
        serve_command(tiny_model, short_socket_path(), tmp_path),
        env={"MOED_DEBUG_FAULTS": "explode=yes"},
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "configuration" in out.stderr and "Traceback" not in out.stderr


def test_memory_plan_refuses_a_model_that_cannot_fit(tmp_path, tiny_model):
    """Refused before loading experts, with the plan in the message, and an exit code that stops
    restarts."""
    d = start_daemon(
        tmp_path,
        tiny_model,
        "--cache-budget",
        "100%",
        env={"MOED_MEMORY_LIMIT_BYTES": "50000000"},
        wait=False,
    )
    try:
        assert d.proc.wait(60) == 6
    finally:
        d.stop()
    log = d.log()
    assert "does not fit" in log and "lower --cache-budget" in log
