"""Live stats and Prometheus metrics from a real streaming daemon with a small expert cache."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moed.client import Client, TokenEvent
from tests.fixtures.daemon_harness import moe, moe_command

pytestmark = pytest.mark.process

BUDGET = "25%"  # 2 of 8 experts per layer at top-2: both hits and misses


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(parsed: dict, name: str, **labels) -> float:
    return parsed[(name, tuple(sorted(labels.items())))]


def generate(client: Client, n: int) -> None:
    for _ in client.generate("hello world", max_tokens=n, raw=True):
        pass


def test_metrics_parse_and_counters_move(tiny_model, daemon_factory):
    d = daemon_factory(tiny_model, "--cache-budget", BUDGET)
    with d.client() as c:
        before = samples(c.metrics()["text"])
        generate(c, 12)
        after = samples(c.metrics()["text"])
        label = {"model": c.stats()["models"][0]["name"]}  # per-model series carry `model`
    assert (
        value(before, "moed_expert_hits_total", **label) == 0
        and value(before, "moed_expert_read_bytes_total", **label) == 0
    )
    assert (
        value(after, "moed_requests_served_total", **label)
        == value(before, "moed_requests_served_total", **label) + 1
    )
    assert (
        value(after, "moed_tokens_generated_total", **label)
        >= value(before, "moed_tokens_generated_total", **label) + 1
    )
    for name in (
        "moed_expert_hits_total",
        "moed_expert_misses_total",
        "moed_expert_read_bytes_total",
        "moed_expert_routed_tokens_total",
        "moed_router_readback_seconds_total",
    ):
        assert value(after, name, **label) > value(before, name, **label), name
    layers = {dict(k[1])["layer"] for k in after if k[0] == "moed_expert_layer_misses_total"}
    assert layers == {"0", "1"}
    assert sum(
        value(after, "moed_expert_layer_hits_total", layer=l, **label) for l in layers
    ) == value(after, "moed_expert_hits_total", **label)
    assert value(after, "moed_expert_cache_budget_bytes", **label) > 0
    assert (
        value(
            after,
            "moed_info",
            version="0.1.0",
            model=tiny_model.name,
            model_type="qwen3_moe",
            boot_id=c.boot_id,
            mode="streaming",
        )
        == 1
    )
    assert value(after, "moed_process_resident_bytes") > 0


def test_prompt_ends_read_ahead_are_counted(tiny_model, daemon_factory):
    """Prompts that end alike (as a chat template ends them): from the second on, the daemon
    reads the experts of the step reading the last token ahead, and says so."""
    d = daemon_factory(
        tiny_model, "--cache-budget", BUDGET, "--prefix-cache", "0", "--page-cache", "bypass"
    )
    with d.client() as c:
        for body in ("the cat sat on the mat", "a bird in the hand", "hello again world"):
            for _ in c.generate(f"{body}\nAnswer:", max_tokens=2, raw=True):
                pass
        parsed = samples(c.metrics()["text"])
        experts = c.stats()["experts"]
        label = {"model": c.stats()["models"][0]["name"]}
    reads = value(parsed, "moed_expert_prompt_end_reads_total", **label)
    assert reads == experts["prompt_end_reads"] > 0
    assert 0 <= value(parsed, "moed_expert_prompt_end_hits_total", **label) <= reads
    assert value(parsed, "moed_expert_speculative_read_bytes_total", **label) > 0
    assert experts["prompt_end_shared"] is not None
    assert "prompt ends" in moe(d.socket, "stats").stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_port_serves_prometheus_on_loopback(tiny_model, daemon_factory):
    port = _free_port()
    d = daemon_factory(tiny_model, "--cache-budget", BUDGET, "--metrics-port", str(port))
    with d.client() as c:
        generate(c, 4)
        label = {"model": c.stats()["models"][0]["name"]}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        parsed = samples(r.read().decode())
    assert value(parsed, "moed_requests_served_total", **label) == 1
    assert value(parsed, "moed_expert_misses_total", **label) > 0
    out = moe(d.socket, "metrics")
    assert out.returncode == 0, out.stderr
    assert value(samples(out.stdout), "moed_requests_served_total", **label) == 1


def test_moe_stats_while_a_generation_runs(tiny_model, daemon_factory):
    d = daemon_factory(tiny_model, "--cache-budget", BUDGET)
    started, done = threading.Event(), threading.Event()

    def long_generation():
        with d.client() as c:
            for ev in c.generate(prompt_ids=[5, 6, 7], max_tokens=400, raw=True):
                if isinstance(ev, TokenEvent) and ev.index >= 3:
                    started.set()
        done.set()

    t = threading.Thread(target=long_generation, daemon=True)
    t.start()
    assert started.wait(60)
    out = moe(d.socket, "stats", "--json")
    assert out.returncode == 0, out.stderr
    live = json.loads(out.stdout)
    human = moe(d.socket, "stats")
    t.join(120)
    assert done.is_set()
    if not live["requests"][
        "active"
    ]:  # the generation ended early (end of sequence): still counted
        assert live["requests"]["served"] == 1
    ex = live["experts"]
    assert ex["hit_rate"] > 0 and ex["bytes_read"] > 0 and ex["hits"] > 0
    assert len(ex["layer_hit_rates"]) == 2 and ex["bytes_read_per_token"] > 0
    assert ex["budget_bytes"] == ex["resident_bytes"] > 0
    assert live["memory"]["rss_bytes"] > 0 and live["memory"]["pressure"] in (
        "normal",
        "warn",
        "critical",
        "unknown",
    )
    assert live["model"]["streaming"] is True and live["tokens"]["generated"] > 0
    assert "last_crash" in live and "restarts" in live
    assert human.returncode == 0, human.stderr
    assert (
        "hit rate" in human.stdout
        and "per layer" in human.stdout
        and "router read-back" in human.stdout
    )


def test_stats_watch_refreshes(daemon):
    proc = subprocess.Popen(
        moe_command(daemon.socket, "stats", "--json", "--watch", "--interval", "0.2"),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [json.loads(proc.stdout.readline()) for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(10)
    assert [l["boot_id"] for l in lines] == [daemon.client().connect()["boot_id"]] * 3
    assert lines[0]["time"] < lines[1]["time"] < lines[2]["time"]
    assert lines[0]["experts"] is None  # the `daemon` fixture is resident


def test_client_side_never_imports_mlx():
    code = (
        "import sys, moed.client.cli, moed.client.stats_cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'mlx' "
        "or m.startswith('moed.daemon')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
