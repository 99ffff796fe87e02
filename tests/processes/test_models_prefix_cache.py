"""Each model's SSD prefix cache through a real two-model daemon: a folder of its own (the
started model the folder itself, another one `models/<name>-<digest>` in it), its own budget from
`[models]`, kept across an unload (the next turn after a reload reads its prefix from the SSD),
listed and cleared by model; tokens always those of the model alone."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moed.client import DoneEvent, TokenEvent
from moed.daemon.experts.budget import parse_size
from tests.fixtures.daemon_harness import moe
from tests.fixtures.reference import generate

pytestmark = pytest.mark.process

SYSTEM = [(11 * i) % 220 + 3 for i in range(48)]
TURNS = [SYSTEM + [5, 6], SYSTEM + [5, 6, 7, 8, 9]]
BUDGETS = {"a": "64MB", "b": "32MB"}  # a: [serve]'s, b: its own


def turn(client, model: str, ids: list[int]) -> tuple[list[int], dict]:
    tokens, usage = [], {}
    for event in client.generate(prompt_ids=ids, model=model, max_tokens=6):
        if isinstance(event, TokenEvent):
            tokens += event.ids
        elif isinstance(event, DoneEvent):
            usage = event.usage
    return tokens, usage


def saved(client, model: str) -> dict | None:
    """The model's prefix-cache counters once an entry is on the SSD."""
    stats = client.prefix_cache(model=model)["stats"]
    return stats if stats and stats["disk_entries"] else None


def wait_for(check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def test_each_model_keeps_its_own_ssd_prefix_cache(checkpoint_factory, daemon_factory, tmp_path):
    paths = {"a": checkpoint_factory("qwen3_moe"), "b": checkpoint_factory("qwen3_5_moe")}
    root = tmp_path / "prefix-cache"
    config = tmp_path / "moed.toml"
    config.write_text(
        f'[serve]\nprefix_cache_dir = "{root}"\nprefix_cache_disk_bytes = "{BUDGETS["a"]}"\n\n'
        f'[models]\na = "{paths["a"]}"\n'
        f'b = {{ path = "{paths["b"]}", prefix_cache_disk = "{BUDGETS["b"]}" }}\n'
    )
    d = daemon_factory("a", "--config", str(config))
    expected = {
        (name, n): generate(path, TURNS[n], 6) for name, path in paths.items() for n in (0, 1)
    }

    def files_of_b() -> list[Path]:
        return list((root / "models").glob("b-*/*.safetensors"))

    with d.client(timeout=60) as c:
        for name in paths:
            tokens, usage = turn(c, name, TURNS[0])
            assert tokens == expected[(name, 0)] and usage["cached_tokens"] == 0
        for name, budget in BUDGETS.items():
            stats = wait_for(lambda n=name: saved(c, n))
            assert stats["disk_budget_bytes"] == parse_size(budget), name
        # The started model's entries in the folder itself, b's in a folder of its own.
        assert list(root.glob("*.safetensors")) and files_of_b()
        assert {p.parent.name[:2] for p in files_of_b()} == {"b-"}

        c.models("unload", "b")
        wait_for(lambda: "b" not in [m["name"] for m in c.models()["loaded"]])
        kept = files_of_b()
        assert kept  # an unload leaves the SSD tier

        tokens, usage = turn(c, "b", TURNS[1])  # b loads again: its prefix comes from the SSD
        assert tokens == expected[("b", 1)]
        assert usage["cached_tokens"] >= len(TURNS[0]), usage
        assert c.prefix_cache(model="b")["stats"]["disk_loads"] == 1

    listed = json.loads(moe(d.socket, "cache", "list", "--model", "b", "--json").stdout)
    assert listed["model"] == "b" and listed["enabled"] and listed["entries"]
    a_files = list(root.glob("*.safetensors"))
    cleared = moe(d.socket, "cache", "clear", "--model", "b")
    assert cleared.returncode == 0, cleared.stderr
    wait_for(lambda: not files_of_b())
    assert list(root.glob("*.safetensors")) == a_files  # a's cache is a's
    with d.client(timeout=60) as c:
        tokens, usage = turn(c, "a", TURNS[1])
        assert tokens == expected[("a", 1)] and usage["cached_tokens"] >= len(TURNS[0])
