"""`moed bench batch` at toy scale: real daemons, the real client, the JSON report's shape, and
single-client streams identical to the solo references at every budget."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.daemon_harness import moed

pytestmark = pytest.mark.process


def test_bench_batch_json_and_table(tiny_model, tmp_path):
    out_file = tmp_path / "batch.json"
    out = moed(
        "bench",
        "batch",
        "--model",
        str(tiny_model),
        "--clients",
        "1,2",
        "--budgets",
        "resident,25%",
        "--max-tokens",
        "8",
        "--rounds",
        "1",
        "--long-prompt",
        "200",
        "--prefill-chunk",
        "64",
        "--json",
        str(out_file),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out_file.read_text())
    assert report["sides"] == ["resident", "25%"] and report["clients"] == [1, 2]
    cells = {(c["side"], c["clients"]): c for c in report["cells"]}
    assert set(cells) == {(s, n) for s in ("resident", "25%") for n in (1, 2)}
    for (_side, n), cell in cells.items():
        assert cell["streams"] == n and sum(cell["tokens_per_run"]) > 0
        assert cell["total_tps"] > 0 and cell["per_client_tps"] > 0 and cell["ttft_ms"] > 0
        assert cell["gap_p99_ms"] >= cell["gap_p50_ms"] >= 0
        assert cell["identical_to_solo"] + len(cell["divergences"]) == n
    # A request alone computes what it computes alone, whatever the budget.
    for side in ("resident", "25%"):
        assert cells[(side, 1)]["ratio_vs_1_client"] == 1.0
        assert cells[(side, 1)]["identical_to_solo"] == 1
    assert len(report["solo"]) == 2 and all(len(s["tokens"]) == 8 for s in report["solo"])
    assert all(len(s["margins"]) == 8 for s in report["solo"])
    long = {r["side"]: r for r in report["long_prompt"]["rows"]}
    assert set(long) == {"resident", "25%"} and report["long_prompt"]["tokens"] == 200
    for row in long.values():
        assert row["long_ttft_ms"] > 0 and row["base_gap_ms"] > 0 and row["window_gaps"][0] > 0
        assert row["window_p99_ms"] >= row["window_p50_ms"] > 0
    exact = report["exactness"]
    assert exact["single_identical"] == exact["single_streams"] == 2
    assert exact["concurrent_streams"] == 4
    drift = exact["logprob_drift"]
    assert set(drift) == {"resident", "25%"}
    assert all(d["tokens"] > 0 and d["max_abs"] >= 0 for d in drift.values())

    # The human table: one line per cell, then the long-prompt and exactness summaries.
    lines = out.stdout.splitlines()
    assert lines[0].startswith("moed bench batch:") and "total tok/s" in lines[1]
    assert [line.split()[:2] for line in lines[2:6]] == [
        ["resident", "1"],
        ["resident", "2"],
        ["25%", "1"],
        ["25%", "2"],
    ]
    assert any(line.startswith("a 200-token prompt arriving") for line in lines)
    assert any(line.startswith("exactness (greedy): 2/2 single-client") for line in lines)
