"""`moed trace analyze`: a trace recorded by a real daemon becomes the table and the PNG plots; the
cache simulators agree with the daemon and with hand-worked examples."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from moed.daemon.experts.policies import DEFAULT_POLICY, LRUPolicy, policy_names
from moed.daemon.telemetry.analyze import simulate, simulate_belady
from tests.fixtures.daemon_harness import moe, moed

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ["hit_rate_vs_cache.png", "popularity.png", "reuse.png", "passes.png"]


def record(daemon, path: Path, prompt: str, tokens: int) -> None:
    out = moe(
        daemon.socket, "run", "--raw", "--max-tokens", str(tokens), "--trace", str(path), prompt
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.process
def test_trace_from_a_model_becomes_table_and_plots(tiny_model, daemon_factory, tmp_path):
    d = daemon_factory(tiny_model, "--cache-budget", "25%")
    record(d, tmp_path / "a.moetrace", "def fibonacci(n):", 24)
    out = moed("trace", "analyze", str(tmp_path / "a.moetrace"), "--out", str(tmp_path / "plots"))
    assert out.returncode == 0, out.stderr
    table = out.stdout
    for heading in (
        "distinct",
        "top-10% share",
        "token-to-token reuse",
        "hit rate vs cache size",
        "lru",
        "belady",
        "<- recorded",
    ):
        assert heading in table, heading
    # The daemon's run replays exactly: same slots, same starting cache, same policy.
    assert "(match)" in table
    for name in PLOTS:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name

    # A second run starts with the first one's experts cached: the recorded row states the run's
    # own hit rate (the one on the `recorded` line), not the empty-cache simulation beside it.
    record(d, tmp_path / "b.moetrace", "class Stack:", 16)
    out = moed("trace", "analyze", str(tmp_path / "b.moetrace"), "--no-plots")
    assert out.returncode == 0, out.stderr
    recorded_line = next(line for line in out.stdout.splitlines() if line.startswith("recorded"))
    hit_pct = re.search(r"hit \d+ \((\d+\.\d%)\)", recorded_line).group(1)
    row = next(line for line in out.stdout.splitlines() if "<- recorded" in line)
    assert f"the run hit {hit_pct}" in row and "experts cached" in row, row
    assert "each simulated from an empty cache" in out.stdout

    # Two traces together, as JSON: the curves are hit rates, Belady never below LRU, all rising.
    out = moed(
        "trace",
        "analyze",
        str(tmp_path / "a.moetrace"),
        str(tmp_path / "b.moetrace"),
        "--json",
        "--no-plots",
        "--sizes",
        "1,2,4,8",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["sizes"] == [1, 2, 4, 8] and report["layers"] == 2 and report["top_k"] == 2
    lru, belady = report["hit_rate"]["lru"], report["hit_rate"]["belady"]
    assert all(b >= l for b, l in zip(belady, lru))
    assert lru == sorted(lru) and 0 < lru[-1] <= 1
    assert report["policy"] == DEFAULT_POLICY  # the daemon's column is its policy's
    assert set(report["hit_rate"]) == {*policy_names(), "belady"}  # a column per policy
    assert report["replay"] is None  # no single starting state for two traces
    assert all(1 <= l["unique"] <= 8 and 0 <= l["reuse"] <= 1 for l in report["per_layer"])


@pytest.mark.process
def test_analyze_rejects_a_file_that_is_not_a_trace(tmp_path):
    bad = tmp_path / "x.moetrace"
    bad.write_bytes(b"\x81\xa1a\x01")
    out = moed("trace", "analyze", str(bad))
    assert out.returncode != 0 and "not a moed trace" in out.stderr


def calls(*sets):
    return [np.array(sorted(s)) for s in sets]


def test_simulators_on_a_worked_example():
    seq = calls({0}, {1}, {2}, {0}, {1}, {3}, {0})
    # LRU with 2 slots: 0 1 2(ev 0) 0(ev 1) 1(ev 2) 3(ev 0) 0(ev 1): no hits.
    assert simulate(seq, 2, LRUPolicy()) == (0, 7)
    # Belady: 0 1 2(ev 1: next use 4 vs 0 at 3... evict the furthest: 1 at t=4 vs 0 at t=3
    # -> evict 1)
    # 0 hit, 1 miss (ev 2: never used again), 3 miss (ev 1: never again), 0 hit.
    assert simulate_belady(seq, 2) == (2, 5)
    # A call of more experts than slots runs in passes and still counts each expert once.
    assert simulate(calls({0, 1, 2}), 1, LRUPolicy()) == (0, 3)
    # Resident experts go first: the second call hits the two still cached, then reads the third.
    assert simulate_belady(calls({0, 1, 2}, {0, 1, 2}), 2) == (2, 4)


def test_the_pass_lane_caches_none_of_its_passes():
    # Two slots, five experts: passes [0 1] [2 3] [4]. In the pool alone the last two passes
    # evict 0 and 1; with the lane [2 3] is read into it, not cached, and [4] evicts 0 (LRU).
    seq = calls({0, 1, 2, 3, 4}, {1})
    assert simulate(seq, 2, LRUPolicy()) == (0, 6)
    assert simulate(seq, 2, LRUPolicy(), lane=True) == (1, 5)
    # A call that fits one pass never uses the lane.
    assert simulate(calls({0, 1}, {0, 1}), 2, LRUPolicy(), lane=True) == (2, 2)


@pytest.mark.slow
def test_belady_is_never_worse_and_full_cache_misses_once():
    rng = random.Random(7)
    for _ in range(30):
        E, k = rng.choice([(8, 2), (16, 4), (32, 4)])
        seq = [np.array(sorted(rng.sample(range(E), k))) for _ in range(rng.randint(5, 60))]
        distinct = len({int(e) for c in seq for e in c})
        for slots in range(1, E + 1):
            lh, lm = simulate(seq, slots, LRUPolicy())
            bh, bm = simulate_belady(seq, slots)
            assert lh + lm == bh + bm == sum(len(c) for c in seq)
            assert bh >= lh
        assert simulate(seq, E, LRUPolicy())[1] == simulate_belady(seq, E)[1] == distinct


@pytest.mark.process
def test_demo_model_trace(daemon_factory, tmp_path):
    from moed.daemon.model.demo import demo_model_path

    d = daemon_factory(demo_model_path(), "--cache-budget", "25%")
    record(d, tmp_path / "demo.moetrace", "def fibonacci(n):", 16)
    out = moed(
        "trace",
        "analyze",
        str(tmp_path / "demo.moetrace"),
        "--out",
        str(tmp_path / "p"),
    )
    assert out.returncode == 0, out.stderr
    assert "(match)" in out.stdout
    assert all((tmp_path / "p" / name).read_bytes().startswith(PNG) for name in PLOTS)
