"""One daemon, several models by name: each model's answers as if served alone, the memory budget
unloading the least recently used idle model (never a pinned one), the typed refusal of an
unknown model, and one model's failure leaving the other's streams whole."""

from __future__ import annotations

import json
import threading
import time

import pytest

from moed.client import DoneEvent, RequestFailed, TokenEvent
from moed.daemon.config import ServeConfig
from moed.daemon.model.footprint import model_footprint
from moed.daemon.watchdog.runner import Watchdog
from tests.fixtures.daemon_harness import moe
from tests.fixtures.gateway_harness import start_gateway
from tests.fixtures.reference import generate
from tests.fixtures.watchdog import ScriptedProbe, watchdog_config

pytestmark = pytest.mark.process

PROMPT = "def fibonacci(n):"
# Settings of every model here: a whole (tiny) expert cache, no prefix memory tier, a small KV
# room; the footprints the daemon plans are then fixed numbers the test computes the same way.
SERVE = {"cache_budget": "100%", "prefix_cache_bytes": "0", "plan_context_tokens": 512}


def tokens(client, model: str, max_tokens: int = 12) -> list[int]:
    ids: list[int] = []
    for event in client.generate(PROMPT, model=model, max_tokens=max_tokens, raw=True):
        if isinstance(event, TokenEvent):
            ids += event.ids
        elif isinstance(event, DoneEvent):
            assert event.finish_reason in ("length", "stop")
    return ids


@pytest.fixture
def three(checkpoint_factory):
    """Three tiny checkpoints of two architectures."""
    return {
        "a": checkpoint_factory("qwen3_moe"),
        "b": checkpoint_factory("qwen3_5_moe"),
        "c": checkpoint_factory("qwen3_moe", seed=3),
    }


def start(daemon_factory, tmp_path, paths, models_memory="auto", env=None, **extra_entries):
    serve = "\n".join(
        f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in SERVE.items()
    )
    lines = ["[serve]", serve, f'models_memory_bytes = "{models_memory}"', "", "[models]"]
    for name, path in paths.items():
        more = "".join(f", {k} = {v}" for k, v in extra_entries.get(name, {}).items())
        lines.append(f'{name} = {{ path = "{path}"{more} }}')
    config = tmp_path / "moed.toml"
    config.write_text("\n".join(lines) + "\n")
    return daemon_factory("a", "--config", str(config), env=env)


def loaded(client) -> list[str]:
    return [m["name"] for m in client.models()["loaded"]]


def test_clients_alternate_models_each_answer_as_alone(three, daemon_factory, tmp_path):
    paths = {"a": three["a"], "b": three["b"]}
    expected = {name: generate(path, PROMPT, 12) for name, path in paths.items()}
    d = start(daemon_factory, tmp_path, paths)
    results: dict[tuple[int, int], tuple[str, list[int]]] = {}

    def client_loop(n: int) -> None:
        with d.client() as c:
            for turn in range(3):  # a, b, a or b, a, b: every request names the other model
                name = "ab"[(n + turn) % 2]
                results[(n, turn)] = (name, tokens(c, name))

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 9
    for name, got in results.values():
        assert got == expected[name], name
    with d.client() as c:
        assert sorted(loaded(c)) == ["a", "b"]  # the budget (auto) holds both


def test_budget_for_two_unloads_the_least_recently_used(three, daemon_factory, tmp_path):
    serve = ServeConfig(**SERVE)  # type: ignore[arg-type]
    sizes = {name: model_footprint(serve, path, 1 << 40) for name, path in three.items()}
    two = sorted(sizes.values())[1:]
    capacity = sum(two) + min(sizes.values()) // 2  # any two fit, never three
    d = start(daemon_factory, tmp_path, three, str(capacity))
    with d.client() as c:
        tokens(c, "b")
        tokens(c, "a")  # b is now the least recently used
        assert sorted(loaded(c)) == ["a", "b"]
        assert tokens(c, "c") == generate(three["c"], PROMPT, 12)
        assert sorted(loaded(c)) == ["a", "c"]
        listing = c.models()
        assert listing["used_bytes"] <= listing["capacity_bytes"] == capacity


def test_pinned_model_stays(three, daemon_factory, tmp_path):
    serve = ServeConfig(**SERVE)  # type: ignore[arg-type]
    sizes = {name: model_footprint(serve, path, 1 << 40) for name, path in three.items()}
    capacity = sum(sorted(sizes.values())[1:]) + min(sizes.values()) // 2
    d = start(daemon_factory, tmp_path, three, str(capacity), a={"pin": "true"})
    with d.client() as c:
        tokens(c, "b")  # a (pinned, started) is now the least recently used
        tokens(c, "c")
        assert sorted(loaded(c)) == ["a", "c"]
        rows = {m["name"]: m for m in c.models()["loaded"]}
        assert rows["a"]["pinned"] is True


def test_a_started_aliases_settings_stay_its_own(three, daemon_factory, tmp_path):
    """a (started) has its own budget and keep_alive in [models]; b has none: b runs with
    [serve]'s, not a's."""
    paths = {"a": three["a"], "b": three["b"]}
    d = start(daemon_factory, tmp_path, paths, a={"budget": '"25%"', "keep_alive": '"30m"'})
    with d.client() as c:
        assert tokens(c, "b") == generate(three["b"], PROMPT, 12)
        rows = {m["name"]: m for m in c.models()["loaded"]}
    assert rows["a"]["cache_budget"] == "25%" and rows["a"]["keep_alive_s"] == 1800
    assert rows["b"]["cache_budget"] == SERVE["cache_budget"]
    assert rows["b"]["keep_alive_s"] == 300  # [serve]'s default keep_alive, 5m


def test_unknown_model_is_refused_listing_the_servable(three, daemon_factory, tmp_path):
    d = start(daemon_factory, tmp_path, {"a": three["a"], "b": three["b"]})
    with d.client() as c:
        with pytest.raises(RequestFailed) as info:
            tokens(c, "no-such-model")
        assert info.value.code == "model_not_found"
        assert "servable here: a, b" in str(info.value)
        names = [m["name"] for m in c.models()["servable"]]
        assert names[:2] == ["a", "b"]
        assert tokens(c, "a") == generate(three["a"], PROMPT, 12)  # still serving


def test_moe_load_ps_and_unload(three, daemon_factory, tmp_path):
    d = start(daemon_factory, tmp_path, {"a": three["a"], "b": three["b"]})
    assert moe(d.socket, "load", "b").returncode == 0
    with d.client() as c:
        wait_until(lambda: c.models()["loaded"][0]["state"] == "ready" and len(loaded(c)) == 2)
    rows = [json.loads(line) for line in moe(d.socket, "ps", "--json").stdout.splitlines()]
    assert [r["name"] for r in rows] == [three["a"].name, "b"]  # the started model first
    assert rows[1]["state"] == "ready" and rows[1]["memory_bytes"] > 0
    assert "b " in moe(d.socket, "ps").stdout
    assert moe(d.socket, "unload", "b").returncode == 0
    with d.client() as c:
        wait_until(lambda: loaded(c) == ["a"])


def wait_until(check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_one_models_failure_spares_the_others_streams(three, daemon_factory, tmp_path):
    # b runs out of memory at every step once it made 2 tokens: recovery in place fails again,
    # and its engine takes the restart path; only b's streams may fail.
    paths = {"a": three["a"], "b": three["b"]}
    d = start(daemon_factory, tmp_path, paths, b={"debug_faults": '"oom_after=2"'})
    expected = generate(three["a"], PROMPT, 48)
    got: dict[str, object] = {}

    def on_a() -> None:
        with d.client() as c:
            got["a"] = tokens(c, "a", 48)

    worker = threading.Thread(target=on_a)
    worker.start()
    with d.client() as c:
        with pytest.raises(RequestFailed) as info:
            tokens(c, "b", 24)
        assert info.value.code == "out_of_memory"
    worker.join(120)
    assert got["a"] == expected
    with d.client() as c:
        assert c.ping()["pong"] is True  # the daemon, and a, serve on
        assert tokens(c, "a") == generate(three["a"], PROMPT, 12)
        assert "b" not in loaded(c)


# The progress deadline, and b's pace: every step of b sleeps STEP_DELAY_MS, so its long answer
# streams for several deadlines (a slower machine only makes it longer) while no gap comes near one.
DEADLINE_S = 2.0
STEP_DELAY_MS = 25
LONG = 240  # tokens: at least 6 s at that pace; the qwen3_5_moe checkpoint never ends earlier


def test_a_busy_model_beside_an_idle_one_is_no_stall(three, daemon_factory, tmp_path):
    """The progress deadline is each model's: b streaming for several deadlines while a (the
    started model) sits idle, then unloaded, stalls nothing, and a watchdog with that deadline
    watching the daemon throughout takes no action (it sees b busy and moving)."""
    paths = {"a": three["a"], "b": three["b"]}
    env = {"MOED_PROGRESS_DEADLINE_S": str(DEADLINE_S)}
    slow_b = {"debug_faults": f'"step_delay_ms={STEP_DELAY_MS}"'}
    d = start(daemon_factory, tmp_path, paths, env=env, b=slow_b)
    expected = generate(three["b"], PROMPT, LONG)
    assert len(expected) == LONG  # the premise: b streams the whole time
    # Samples every 0.5 s (each status call may take that long); acts past 1.5 deadlines.
    config = watchdog_config(
        tmp_path, d.socket, interval_s=0.5, progress_timeout_s=1.5 * DEADLINE_S
    )
    signals: list[tuple[int, int]] = []
    dog = Watchdog(config, probe=ScriptedProbe(), send_signal=lambda *sig: signals.append(sig))
    decisions = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(config.interval_s):
            decisions.append(dog.tick())

    dog.startup()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with d.client() as c:
            assert tokens(c, "a") == generate(three["a"], PROMPT, 12)  # a moved, long ago
            for unload_a in (False, True):
                if unload_a:
                    c.models("unload", "a")
                    wait_until(lambda: "a" not in loaded(c))
                began = time.monotonic()
                assert tokens(c, "b", LONG) == expected
                assert time.monotonic() - began > 2 * DEADLINE_S  # it outlasted the deadline
                status = c.status()
                assert status["stalled"] is False and status["state"] != "stalled"
    finally:
        watching.set()
        watcher.join(30)
        dog.shutdown()
    assert [x.reason for x in decisions if x.action is not None] == [] and signals == []
    assert any(x.readings["daemon"]["busy"] for x in decisions)  # it watched b's work


def test_a_wedged_model_fails_only_its_own_streams(three, daemon_factory, tmp_path):
    """a's engine blocks for good after 2 tokens (hang_after) while b streams: a's request ends
    with the retryable `engine_stalled` at its deadline and new work for a is refused so, while
    b's stream runs on to the tokens b gives alone and b takes new work."""
    paths = {"a": three["a"], "b": three["b"]}
    env = {"MOED_PROGRESS_DEADLINE_S": str(DEADLINE_S)}
    entries = {"a": {"debug_faults": '"hang_after=2"'}, "b": {"debug_faults": '"step_delay_ms=25"'}}
    d = start(daemon_factory, tmp_path, paths, env=env, **entries)
    long = LONG  # b streams for at least 6 s: the wedge is met while it runs
    expected = generate(three["b"], PROMPT, long)
    assert len(expected) == long
    got: dict[str, object] = {}
    b_began = threading.Event()

    def on_b() -> None:
        ids: list[int] = []
        with d.client() as c:
            for event in c.generate(PROMPT, model="b", max_tokens=long, raw=True):
                if isinstance(event, TokenEvent):
                    ids += event.ids
                    b_began.set()
        got["b"] = ids

    worker = threading.Thread(target=on_b)
    worker.start()
    try:
        assert b_began.wait(120)
        with d.client() as c:
            with pytest.raises(RequestFailed) as info:
                tokens(c, "a", 24)
            assert info.value.code == "engine_stalled" and info.value.retryable
            with pytest.raises(RequestFailed) as again:
                tokens(c, "a", 4)
            assert again.value.code == "engine_stalled"
            assert c.ping()["pong"] is True
    finally:
        worker.join(300)
    assert got["b"] == expected  # whole, and as served alone
    with d.client() as c:
        assert tokens(c, "b") == generate(three["b"], PROMPT, 12)
        assert c.status()["stalled"] is True  # a's engine is still wedged: the watchdog's cue


def test_gateway_lists_loads_unloads_and_answers_each_model(three, daemon_factory, tmp_path):
    import ollama
    import openai

    d = start(daemon_factory, tmp_path, {"a": three["a"], "b": three["b"]})
    gateway = start_gateway(tmp_path / "gw", d.socket)
    try:
        oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        listed = {m.id: m.model_extra.get("context_length") for m in oai.models.list()}
        assert "b" in listed and listed["b"]  # servable before it is loaded, with its context
        llama = ollama.Client(host=gateway.url)
        assert "b:latest" in [m.model for m in llama.list().models]
        assert llama.generate(model="b", prompt="").done_reason == "load"  # ollama's load
        with d.client() as c:
            wait_until(lambda: "b" in loaded(c) and c.models()["loaded"][0]["state"] == "ready")
        assert "b:latest" in [m.model for m in llama.ps().models]
        for name in ("a", "b"):
            reply = oai.completions.create(model=name, prompt=PROMPT, max_tokens=4)
            assert reply.choices[0].text is not None and reply.usage.completion_tokens > 0
        assert llama.generate(model="b", prompt="", keep_alive=0).done_reason == "unload"
        with d.client() as c:
            wait_until(lambda: "b" not in loaded(c))
        assert "b:latest" not in [m.model for m in llama.ps().models]
    finally:
        gateway.stop()
