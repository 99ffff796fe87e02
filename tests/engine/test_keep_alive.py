"""Keep-alive: an idle daemon releases the model and its expert cache (RSS falls, state `idle`);
the next request reloads it, its client sees load progress, and the tokens are the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from moed.client import DoneEvent, ProgressEvent, RequestFailed, TokenEvent
from moed.protocol.messages import PROMPT_STAGE
from moed.protocol.units import parse_keep_alive
from tests.fixtures.checkpoints import large_checkpoint_kwargs

PROMPT = "def walk(path):\n    for root, dirs, files in os.walk(path):\n        "


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    """About 100 MB of float32 experts over 2 layers: enough to see in the daemon's RSS."""
    from tests.fixtures.checkpoints import write_checkpoint

    dest = tmp_path_factory.mktemp("keepalive") / "qwen3_moe-96mb"
    return write_checkpoint(dest, "qwen3_moe", **large_checkpoint_kwargs(96, num_layers=2))


def generate(client, **kwargs) -> tuple[list[int], list[ProgressEvent]]:
    ids, progress = [], []
    for event in client.generate(PROMPT, max_tokens=8, raw=True, **kwargs):
        if isinstance(event, TokenEvent):
            ids += event.ids
        elif isinstance(event, ProgressEvent) and event.stage != PROMPT_STAGE:
            assert not ids, "load progress comes before the first token"
            progress.append(event)
        elif isinstance(event, DoneEvent):
            assert event.usage["completion_tokens"] == 8
    return ids, progress


def wait_for_state(client, state: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.status()
        if status["state"] == state:
            return status
        time.sleep(0.05)
    raise AssertionError(f"state is {status['state']!r}, not {state!r}, after {timeout_s}s")


@pytest.mark.process
def test_idle_unload_releases_memory_and_reload_gives_the_same_tokens(daemon_factory, mid_model):
    d = daemon_factory(mid_model, "--cache-budget", "100%", "--keep-alive", "1s")
    with d.client(timeout=30) as c:
        # A request's keep_alive (-1: never) outlasts the daemon's 1 s.
        first, progress = generate(c, keep_alive=-1)
        assert not progress
        time.sleep(1.5)
        loaded = c.status()
        assert loaded["state"] == "ready" and loaded["keep_alive_s"] == -1
        # The experts read into slots (their pages touched): an untouched slot is in no RSS.
        held = loaded["streaming"]
        cache_bytes = held["cached_experts"] * held["expert_bytes"]
        assert cache_bytes > 0

        # The next request takes the daemon's 1 s: then model and cache are released.
        second, _ = generate(c)
        assert second == first
        idle = wait_for_state(c, "idle", timeout_s=1 + 20)
        assert idle["unloads"] == 1 and idle["streaming"] is None
        assert idle["model"]["path"] == loaded["model"]["path"]  # `moe ps` still names it
        freed = loaded["rss_bytes"] - idle["rss_bytes"]
        assert freed >= cache_bytes / 2, (loaded["rss_bytes"], idle["rss_bytes"], cache_bytes)

        # The next request reloads (its client sees progress) and gives the same tokens.
        third, progress = generate(c, keep_alive="5m")
        assert third == first
        stages = [p.stage for p in progress]
        assert "loading weights" in stages and stages[-1] == "ready"
        weights = [p for p in progress if p.stage == "loading weights"]
        assert weights[-1].done == weights[-1].total > 0 and weights[-1].unit == "bytes"
        again = c.status()
        assert again["state"] == "ready" and again["keep_alive_s"] == 300
        assert again["rss_bytes"] - idle["rss_bytes"] >= cache_bytes / 2


@pytest.mark.process
def test_keep_alive_zero_unloads_at_once_and_moe_run_json_shows_progress(
    daemon_factory, tiny_model
):
    d = daemon_factory(tiny_model, "--keep-alive", "0")
    with d.client() as c:
        wait_for_state(c, "idle")  # loaded at start, idle at once
    env = {**os.environ}
    out = subprocess.run(
        [sys.executable, "-m", "moed.client.cli", "--socket", str(d.socket), "run", "--json",
         "--raw", "--no-start", "--max-tokens", "3", "def f"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    kinds = [line["type"] for line in lines]
    assert kinds[0] == "progress" and kinds.index("token") > kinds.index("progress")
    assert any(line.get("task") == "loading: loading weights" for line in lines)
    assert kinds[-1] == "done"
    ps = subprocess.run(
        [sys.executable, "-m", "moed.client.cli", "--socket", str(d.socket), "ps", "--json"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    row = json.loads(ps.stdout)
    assert row["name"] == tiny_model.name and row["keep_alive_s"] == 0
    with d.client() as c:
        wait_for_state(c, "idle")  # keep_alive 0: released again once the run ended
    table = subprocess.run(
        [sys.executable, "-m", "moed.client.cli", "--socket", str(d.socket), "ps"],
        capture_output=True, text=True, timeout=60, env=env,
    ).stdout  # fmt: skip
    assert "idle" in table and "released" in table and "unloaded" in table


@pytest.mark.process
def test_a_bad_keep_alive_is_a_typed_error(daemon):
    with daemon.client() as c, pytest.raises(RequestFailed) as err:
        list(c.generate("x", max_tokens=1, keep_alive="soon"))
    assert err.value.code == "invalid_request" and "keep_alive" in str(err.value)


@pytest.mark.parametrize(
    "spec,seconds",
    [("5m", 300), ("-1", None), (0, 0), ("1h30m", 5400), ("90", 90), (2.5, 2.5), ("-5m", None)],
)
def test_keep_alive_durations_read_like_ollama(spec, seconds):
    assert parse_keep_alive(spec) == seconds
