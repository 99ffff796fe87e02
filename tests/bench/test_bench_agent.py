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
    args += ["--user-tokens", "8", "--max-tokens", "4", "--prefill-chunk", "16", "--repeats", "2"]
    args += ["--json", str(out)]
    done = moed(*args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "after a restart / warm turn 2" in done.stdout and "mlx_lm.server" in done.stdout
    assert "the model's own floor" in done.stdout
    report = json.loads(out.read_text())
    sides = {s["name"]: s for s in report["sides"]}
    assert set(sides) == {"resident", "25%"}
    assert all(len(s["runs"]) == 2 for s in sides.values())
    # mlx_lm.server's turns of the same conversations, sent beside each side's
    assert all(len(s["beside"]) == 2 and len(s["beside"][0]["turns"]) == 2 for s in sides.values())
    for name in ("resident", "25%"):
        for run in sides[name]["runs"]:  # two conversations, each continued after a restart
            turns = run["turns"]
            assert turns[0]["cached_tokens"] == 0 and turns[1]["cached_tokens"] > 0
            restarted = run["restarted"]  # read from the SSD tier by the new daemon
            assert restarted["cached_tokens"] >= turns[1]["prompt_tokens"] - 8
            assert all(t["ttft_s"] > 0 for t in turns)
    assert sides["25%"]["runs"][0]["turns"][0]["read_bytes"] > 0  # a streaming side reads experts
    assert report["model_bound"]["after_context_s"] > 0 and report["model_bound"]["alone_s"] > 0


def test_bench_agent_as_a_pipeline_continues_from_every_ranks_ssd_files(tiny_model, tmp_path):
    out = tmp_path / "agent.json"
    args = ["bench", "agent", "--model", str(tiny_model), "--system-tokens", "40", "--turns", "2"]
    args += ["--user-tokens", "8", "--max-tokens", "4", "--prefill-chunk", "16", "--repeats", "1"]
    args += ["--pipeline", "2", "--no-mlx-lm", "--json", str(out)]
    done = moed(*args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a pipeline of 2 ranks" in done.stdout
    report = json.loads(out.read_text())
    assert report["ranks"] == 2
    for side in report["sides"]:
        (run,) = side["runs"]
        assert run["turns"][1]["cached_tokens"] > 0
        # The restarted group read its prefix from every rank's own files.
        assert run["restarted"]["cached_tokens"] >= run["turns"][1]["prompt_tokens"] - 8, run
