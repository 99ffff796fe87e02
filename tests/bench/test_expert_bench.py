"""`moed bench stream` at toy scale, and its cache simulations (LRU, Belady) on known traces."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moed.daemon.bench.stream import stream
from moed.daemon.telemetry.analyze import simulate_layers as simulate


def test_belady_on_a_known_trace():
    # Classic single-request trace, 3 slots: Belady makes 7 misses, LRU 10.
    trace = [[{e}] for e in [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]]
    assert simulate(trace, 3, "belady") == (11, 9)
    assert simulate(trace, 3, "lru") == (8, 12)


def test_belady_never_worse_than_lru_with_sets_and_passes():
    import random

    rnd = random.Random(0)
    for slots in (1, 2, 4, 8):
        trace = [[set(rnd.sample(range(16), 4))] for _ in range(60)]
        bh, bm = simulate(trace, slots, "belady")
        lh, lm = simulate(trace, slots, "lru")
        assert bh + bm == lh + lm  # same pass rule: same number of requests
        assert bh >= lh


def test_simulate_sums_layers():
    trace = [[{0, 1}, {2}], [{0}, {3}], [{1}, {2}]]
    h, m = simulate(trace, 2, "lru")
    assert (h, m) == (3, 4)


@pytest.mark.slow
def test_bench_stream_tiny(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        stream,
        [
            "--layers",
            "2",
            "--hidden",
            "128",
            "--expert-width",
            "64",
            "--experts",
            "16",
            "--top-k",
            "4",
            "--vocab",
            "512",
            "--tokens",
            "8",
            "--warmup",
            "4",
            "--raw-sample-mb",
            "2",
            "--budgets",
            "25%,100%",
            "--model-dir",
            str(tmp_path / "model"),
            "--json",
            str(out),
            "--sweep",
        ],
    )
    assert result.exit_code == 0, result.output
    text = result.output
    assert "raw parallel pread" in text and "time per decode token" in text
    assert "samples between decode tokens" in text  # raw sampled among the tokens, too
    assert "read path sweep" in text and "best:" in text and "syncs/tok" in text
    assert "reproduces" in text
    data = json.loads(out.read_text())
    names = [r["name"] for r in data["runs"]]
    assert names == ["25%", "100%", "25%+spec", "100%+pre", "100%+pre,host"]
    resident = data["resident"]["tokens"]
    for run in data["runs"]:
        assert run["tokens"] == resident
        c = run["counters"]
        if c["misses"]:
            assert c["bytes_read"] == c["misses"] * run["expert_bytes"]
        bh, bm = run["belady"]
        if bh + bm:
            assert (
                bh / (bh + bm)
                >= run["hits_total"] / (run["hits_total"] + run["misses_total"]) - 1e-9
            )
    preloaded, host_routed = data["runs"][-2:]
    assert preloaded["counters"]["misses"] == host_routed["counters"]["misses"] == 0
    # The host-routed twin reads every layer back (the floor's syncs); the other routes on device.
    assert host_routed["counters"]["host_syncs"] > 0 == preloaded["counters"]["host_syncs"]
    assert "floor tok/s" in text
