"""`moed bench switch` at toy scale: one real daemon serving two tiny checkpoints of two
architectures under a budget that holds one, the real client timing switches beside requests to
the loaded model, and every answer identical to that model served alone."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.fixtures.daemon_harness import moed
from tests.fixtures.reference import generate

pytestmark = pytest.mark.process


def test_bench_switch_reports_the_switch_beside_the_loaded_model(checkpoint_factory, tmp_path):
    a, b = checkpoint_factory("qwen3_moe"), checkpoint_factory("qwen3_5_moe")
    out_file = tmp_path / "switch.json"
    out = moed(
        "bench",
        "switch",
        "--models",
        f"{a},{b}",
        "--max-tokens",
        "6",
        "--rounds",
        "2",
        "--json",
        str(out_file),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out_file.read_text())
    # Either model fits the shared budget alone, never both: every first request was a switch.
    sizes = report["footprints"]
    assert max(sizes.values()) <= report["capacity_bytes"] < sum(sizes.values())
    timed = report["requests_timed"]
    assert [(t["model"], t["switch"]) for t in timed] == [
        ("first", True),
        ("first", False),
        ("second", True),
        ("second", False),
    ] * 2
    for t in timed:
        assert t["tokens"] and t["total_ms"] >= t["ttft_ms"] > 0
    # Each model's answers, switched to or loaded, are its answer served alone.
    models = report["models"].items()
    alone = {name: generate(Path(p), "def fibonacci(n):", 6) for name, p in models}
    assert report["references"] == alone
    assert all(t["tokens"] == alone[t["model"]] for t in timed)
    assert report["identical"] == report["requests"] == 8
    rows = report["rows"]
    assert set(rows) == {"ttft_ms", "total_ms", "decode_tps"}
    for field in ("ttft_ms", "total_ms"):
        loaded = [t[field] for t in timed if not t["switch"]]
        switch = [t[field] for t in timed if t["switch"]]
        assert rows[field]["loaded"] == round(statistics.median(loaded), 3)
        assert rows[field]["switch"] == round(statistics.median(switch), 3)
        ratio = statistics.median(switch) / statistics.median(loaded)
        assert rows[field]["ratio"] == pytest.approx(ratio, abs=1e-3)

    lines = out.stdout.splitlines()
    assert lines[0].startswith("moed bench switch:") and "switch/loaded" in lines[1]
    assert lines[2].startswith("time to first token (ms)") and len(lines[2].split()) == 8
    identical = "answers identical to the model's first answer: 8/8"
    assert any(line.startswith(identical) for line in lines)


def test_bench_switch_refuses_one_model(tiny_model):
    out = moed("bench", "switch", "--models", str(tiny_model), timeout=60)
    assert out.returncode != 0 and "two models" in out.stderr
