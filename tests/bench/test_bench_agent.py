"""`moed bench agent` end to end on the tiny checkpoint: real daemons, gateways and mlx_lm.server;
the numbers are the benchmark's business, the test checks the run and what it reports."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.daemon_harness import moed

pytestmark = pytest.mark.process


def test_bench_agent_runs_a_conversation_and_a_restart_beside_mlx_lm(tiny_model, tmp_path):
    out = tmp_path / "agent.json"
    args = ["bench", "agent", "--model", str(tiny_model), "--system-tokens", "40", "--turns", "2"]
    args += ["--user-tokens", "8", "--max-tokens", "4", "--prefill-chunk", "16", "--json", str(out)]
    done = moed(*args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "after a restart / warm turn 2" in done.stdout and "mlx_lm.server" in done.stdout
    report = json.loads(out.read_text())
    sides = {s["name"]: s for s in report["sides"]}
    assert set(sides) == {"resident", "25%", "mlx_lm.server"}
    for name in ("resident", "25%"):
        turns = sides[name]["turns"]
        assert turns[0]["cached_tokens"] == 0 and turns[1]["cached_tokens"] > 0
        restarted = sides[name]["restarted"]  # read from the SSD tier by the new daemon
        assert restarted["cached_tokens"] >= turns[1]["prompt_tokens"] - 8
        assert all(t["ttft_s"] > 0 for t in turns)
    assert sides["25%"]["turns"][0]["read_bytes"] > 0  # a streaming side reads experts
