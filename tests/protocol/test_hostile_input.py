"""Hostile input against a real daemon: every frame of issue 11 and what the validation layer adds.

Each frame gets its typed error (nothing reaches MLX); after the whole corpus the daemon serves a
normal request with the same tokens as before it, and it has recorded no crash.
"""

from __future__ import annotations

import json

import msgpack
import pytest
import zmq

from tests.fixtures.daemon_harness import start_daemon

pytestmark = pytest.mark.process

GENERATE = {"v": 1, "type": "generate", "raw": True}


def gen(request_id, **fields) -> dict:
    return {**GENERATE, "id": request_id, **fields}


def corpus(vocab: int, context: int) -> list[tuple[str, bytes, str]]:
    """(name, frame, expected error code); built from the loaded model's limits."""
    deep: list = []
    for _ in range(100):
        deep = [deep]
    frames = [
        # The frames.
        ("id 2**31", gen("a", prompt_ids=[2147483648]), "invalid_request"),
        ("resume id past vocab", gen("b", prompt_ids=[1], resume_ids=[999999]), "invalid_request"),
        ("id == vocab", gen("c", prompt_ids=[vocab]), "invalid_request"),
        ("id 2**40", gen("d", prompt_ids=[2**40]), "invalid_request"),
        ("temperature nan", gen("e", prompt="hi", temperature=float("nan")), "invalid_request"),
        ("temperature inf", gen("f", prompt="hi", temperature=float("inf")), "invalid_request"),
        ("empty prompt, templated", {**gen("g", prompt=""), "raw": False}, "invalid_request"),
        ("ext type", gen("h", prompt="hi", x=msgpack.ExtType(7, b"x")), "bad_frame"),
        ("timestamp ext", gen("i", prompt="hi", at=msgpack.Timestamp(1, 0)), "bad_frame"),
        ("prompt over context", gen("j", prompt_ids=[1] * (context + 10)), "prompt_too_long"),
        ("telemetry_every 0", gen("k", prompt="hi", telemetry_every=0), "invalid_request"),
        # What the validation layer adds.
        ("v float", {"v": 1.0, "type": "ping", "id": "l"}, "invalid_request"),
        ("max_tokens float", gen("m", prompt="hi", max_tokens=5.0), "invalid_request"),
        ("max_tokens 0", gen("n", prompt="hi", max_tokens=0), "invalid_request"),
        ("max_tokens 2**64-1", gen("o", prompt="hi", max_tokens=2**64 - 1), "invalid_request"),
        ("negative id", gen("p", prompt_ids=[-1]), "invalid_request"),
        ("bool id", gen("q", prompt_ids=[True]), "invalid_request"),
        ("float id", gen("r", prompt_ids=[1.0]), "invalid_request"),
        ("empty ids", gen("s", prompt_ids=[]), "invalid_request"),
        ("prompt and ids", gen("t", prompt="hi", prompt_ids=[1]), "invalid_request"),
        ("top_p 0", gen("u", prompt="hi", top_p=0.0), "invalid_request"),
        ("top_p nan", gen("u2", prompt="hi", top_p=float("nan")), "invalid_request"),
        ("temperature -1", gen("w", prompt="hi", temperature=-1), "invalid_request"),
        ("seed -1", gen("x", prompt="hi", seed=-1), "invalid_request"),
        ("seed 2**64-1", gen("y", prompt="hi", seed=2**64 - 1), "invalid_request"),
        ("raw as int", gen("z", prompt="hi", raw=1), "invalid_request"),
        (
            "resume reaches max_tokens",
            gen("aa", prompt_ids=[1], resume_ids=[2, 3], max_tokens=2),
            "invalid_request",
        ),
        ("model as list", gen("ab", prompt="hi", model=["x"]), "invalid_request"),
        ("id float", {"v": 1, "type": "ping", "id": 1.5}, "invalid_request"),
        ("id list", {"v": 1, "type": "ping", "id": [1]}, "invalid_request"),
        ("id too long", {"v": 1, "type": "ping", "id": "x" * 1000}, "invalid_request"),
        ("no id", {"v": 1, "type": "ping"}, "invalid_request"),
        ("no v", {"type": "ping", "id": "ac"}, "invalid_request"),
        (
            "cancel target map",
            {"v": 1, "type": "cancel", "id": "ad", "target": {}},
            "invalid_request",
        ),
        ("shed level", {"v": 1, "type": "shed", "id": "ae", "level": "nuke"}, "invalid_request"),
        ("shed, no token", {"v": 1, "type": "shed", "id": "af"}, "not_permitted"),
        ("shutdown, no token", {"v": 1, "type": "shutdown", "id": "ag"}, "not_permitted"),
        (
            "shutdown, bad token",
            {"v": 1, "type": "shutdown", "id": "ah", "token": "guess"},
            "not_permitted",
        ),
        ("nested 100 deep", gen("ai", prompt="hi", extra=deep), "bad_frame"),
        ("key not a string", None, "bad_frame"),
        # Text that could not fit, refused before tokenizing (count_tokens runs on the transport).
        (
            "count_tokens huge",
            {"v": 1, "type": "count_tokens", "id": "aj", "prompt": "x" * (context * 33)},
            "prompt_too_long",
        ),
        (
            "messages huge",
            {
                **gen("ak", messages=[{"role": "user", "content": "x" * (context * 33)}]),
                "raw": False,
            },
            "prompt_too_long",
        ),
        (
            "messages bad role",
            {**gen("al", messages=[{"role": "god", "content": "x"}]), "raw": False},
            "invalid_request",
        ),
    ]
    out = []
    for name, msg, code in frames:
        if msg is None:
            frame = msgpack.packb({1: "v"}, strict_types=False)
        else:
            frame = msgpack.packb(msg, datetime=False)
        out.append((name, frame, code))
    return out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model):
    """One daemon for the module: the corpus must leave it serving anyway."""
    d = start_daemon(tmp_path_factory.mktemp("hostile"), tiny_model, "--resident")
    yield d
    d.stop()


@pytest.fixture
def raw(daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{daemon.socket}")
    yield sock
    sock.close()


def _reply(sock, frame: bytes) -> dict:
    sock.send(frame)
    assert sock.poll(10_000), "no answer"
    return msgpack.unpackb(sock.recv())


def _greedy_tokens(client) -> list[int]:
    ids = []
    for event in client.generate("hello there", max_tokens=12, raw=True):
        ids.extend(getattr(event, "ids", []))
    return ids


def test_hostile_corpus_gets_typed_errors_and_changes_nothing(daemon, raw):
    with daemon.client() as c:
        limits = c.connect()["limits"]
        before = _greedy_tokens(c)
    assert limits["vocab_size"] and limits["context_tokens"]
    results = {}
    for name, frame, code in corpus(limits["vocab_size"], limits["context_tokens"]):
        reply = _reply(raw, frame)
        results[name] = reply.get("code")
        assert reply["type"] == "error" and reply["code"] == code, (name, reply)
        assert reply["message"], name
    # Unknown fields are ignored, not refused: this one runs.
    reply = _reply(raw, msgpack.packb(gen("ok", prompt="hi", max_tokens=1, future_field=1)))
    while reply["type"] not in ("done", "error"):
        assert raw.poll(10_000)
        reply = msgpack.unpackb(raw.recv())
    assert reply["type"] == "done", reply
    with daemon.client() as c:
        assert _greedy_tokens(c) == before  # identical tokens after the whole corpus
        status = c.status()
    assert status["state"] == "ready" and status["recent_crashes"] == 0
    assert status["last_crash"] is None and daemon.proc.poll() is None
    crash_file = daemon.state_dir / "crash.json"
    history = json.loads(crash_file.read_text()).get("history", []) if crash_file.exists() else []
    assert history == [], history


def test_float_v_is_told_so(daemon, raw):
    reply = _reply(raw, msgpack.packb({"v": 1.0, "type": "hello", "id": 1}))
    assert reply["code"] == "invalid_request" and "float" in reply["message"]


def test_text_prompt_over_context_is_refused_after_tokenizing(daemon, raw):
    """Ids from a text prompt get the same context rule as prompt_ids, before anything runs."""
    limits = _reply(raw, msgpack.packb({"v": 1, "type": "hello", "id": 0}))["limits"]
    words = " ".join(["hello"] * (limits["context_tokens"] + 50))
    reply = _reply(raw, msgpack.packb(gen("long", prompt=words)))
    assert reply["code"] == "prompt_too_long", reply
    assert str(limits["context_tokens"]) in reply["message"]


def test_a_strict_max_tokens_is_refused_with_the_numbers(daemon, raw):
    """`strict_max_tokens`: what the daemon would cap is refused, and every budget refusal says
    prompt tokens and the limit crossed (a gateway answers in its API's words from them), for a
    text prompt once tokenized and for prompt_ids at the edge."""
    limits = _reply(raw, msgpack.packb({"v": 1, "type": "hello", "id": 0}))["limits"]
    context = limits["context_tokens"]
    text = "hello there, how are you"
    counted = _reply(
        raw, msgpack.packb({"v": 1, "type": "count_tokens", "id": 1, "prompt": text, "raw": True})
    )
    n = counted["tokens"]

    reply = _reply(
        raw, msgpack.packb(gen("ctx", prompt=text, max_tokens=context, strict_max_tokens=True))
    )
    assert reply["code"] == "context_exceeded", reply
    assert reply["budget"] == {"prompt_tokens": n, "max_tokens": context, "limit": context}

    over = limits["max_tokens"] + 1
    ids = [5] * 10
    reply = _reply(
        raw, msgpack.packb(gen("cap", prompt_ids=ids, max_tokens=over, strict_max_tokens=True))
    )
    assert reply["code"] == "max_tokens_too_large", reply
    assert reply["budget"] == {
        "prompt_tokens": 10,
        "max_tokens": over,
        "limit": limits["max_tokens"],
    }

    reply = _reply(
        raw, msgpack.packb(gen("long", prompt_ids=[5] * context, strict_max_tokens=True))
    )
    assert reply["code"] == "prompt_too_long", reply
    assert reply["budget"] == {"prompt_tokens": context, "limit": context - 1}

    # Within the budget the strict request runs as any other.
    reply = _reply(raw, msgpack.packb(gen("ok", prompt=text, max_tokens=2, strict_max_tokens=True)))
    while reply["type"] not in ("done", "error"):
        assert raw.poll(10_000)
        reply = msgpack.unpackb(raw.recv())
    assert reply["type"] == "done" and "notice" not in reply, reply
