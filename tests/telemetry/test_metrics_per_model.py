"""Prometheus and `moe stats` of a daemon serving two models: every per-model series (requests,
tokens, expert cache, prefix cache) once per model under its `model` label, counted apart, and
kept while its model is unloaded."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moed.client import TokenEvent
from tests.fixtures.daemon_harness import moe
from tests.fixtures.reference import generate

pytestmark = pytest.mark.process

PROMPT = "def fibonacci(n):"
MAX_TOKENS = {"a": 10, "b": 6}


def samples(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed[(name, tuple(sorted(labels.items())))]


def test_two_models_are_scraped_under_their_own_labels(
    checkpoint_factory, daemon_factory, tmp_path
):
    paths = {"a": checkpoint_factory("qwen3_moe"), "b": checkpoint_factory("qwen3_5_moe")}
    config = tmp_path / "moed.toml"
    config.write_text(
        '[serve]\ncache_budget = "25%"\n\n[models]\n'
        + "".join(f'{name} = "{path}"\n' for name, path in paths.items())
    )
    d = daemon_factory("a", "--config", str(config))
    counts: dict[str, int] = {}  # tokens each model generated (an end of sequence may come early)
    with d.client() as c:
        for name, n in MAX_TOKENS.items():
            ids = []
            for event in c.generate(PROMPT, model=name, max_tokens=n, raw=True):
                if isinstance(event, TokenEvent):
                    ids += event.ids
            assert ids == generate(paths[name], PROMPT, n), name  # as if served alone
            counts[name] = len(ids)
        parsed = samples(c.metrics()["text"])
        body = c.stats()

    assert [m["name"] for m in body["models"]] == ["a", "b"]
    for name, n in counts.items():
        label = {"model": name}
        assert value(parsed, "moed_model_loaded", **label) == 1
        assert value(parsed, "moed_requests_served_total", **label) == 1
        assert value(parsed, "moed_tokens_generated_total", **label) == n
        hits = value(parsed, "moed_expert_hits_total", **label)
        assert hits + value(parsed, "moed_expert_misses_total", **label) > 0
        assert value(parsed, "moed_expert_cache_budget_bytes", **label) > 0
        assert value(parsed, "moed_prefix_cache_lookups_total", **label) == 1
        layers = {
            dict(k[1]).get("layer")
            for k in parsed
            if k[0] == "moed_expert_layer_misses_total" and dict(k[1]).get("model") == name
        }
        assert layers == {"0", "1"}, name  # per layer, and per model
        row = next(m for m in body["models"] if m["name"] == name)
        assert row["requests"]["served"] == 1 and row["tokens"]["generated"] == n
        assert row["experts"]["hits"] == hits and row["loaded"] is True
    # No per-model series without its label: a scraper never sums one model twice.
    assert not [k for k in parsed if k[0] == "moed_requests_served_total" and not k[1]]

    human = moe(d.socket, "stats").stdout
    assert "model a  loaded  served 1" in human and "model b  loaded  served 1" in human

    assert moe(d.socket, "unload", "b").returncode == 0
    deadline = time.monotonic() + 60
    while True:  # the unload runs on b's engine thread
        rows = json.loads(moe(d.socket, "stats", "--json").stdout)["models"]
        if not next(m for m in rows if m["name"] == "b")["loaded"]:
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.1)
    with d.client() as c:
        parsed = samples(c.metrics()["text"])
    assert value(parsed, "moed_model_loaded", model="b") == 0
    assert value(parsed, "moed_requests_served_total", model="b") == 1  # a counter stays
    assert value(parsed, "moed_tokens_generated_total", model="b") == counts["b"]
    assert value(parsed, "moed_model_loaded", model="a") == 1
