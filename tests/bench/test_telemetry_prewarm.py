"""`moed bench prewarm`: three starts side by side on a real streaming model, identical tokens."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.fixtures.daemon_harness import moed

pytestmark = pytest.mark.process


def bench(*args: str) -> subprocess.CompletedProcess:
    return moed("bench", "prewarm", *args, timeout=300)


def test_prewarm_bench_json_and_table(tiny_model, tmp_path):
    trace = tmp_path / "hot.moetrace"
    out = bench(
        "--model",
        str(tiny_model),
        "--runs",
        "1",
        "--max-tokens",
        "8",
        "--json",
        "--save-trace",
        str(trace),
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["identical_tokens"] is True
    runs = {name: rs[0] for name, rs in report["scenarios"].items()}
    assert set(runs) == {"cold", "warm page cache", "prewarm"}
    assert runs["prewarm"]["preload_bytes"] > 0 and runs["cold"]["preload_bytes"] == 0
    assert runs["warm page cache"]["page_cache_before"] == 1.0
    for r in runs.values():
        assert r["ttft_s"] > 0 and r["decode_tps"] > 0 and 0 <= r["hit_rate"] <= 1
    assert "recording a trace" in out.stderr and "run 3/3" in out.stderr  # progress lines

    # A previous trace instead of a fresh recording; the human table.
    out = bench(
        "--model", str(tiny_model), "--runs", "1", "--max-tokens", "8", "--trace", str(trace)
    )
    assert out.returncode == 0, out.stderr
    assert "hot experts from 1 trace(s)" in out.stderr
    lines = out.stdout.splitlines()
    assert [l.split()[0] for l in lines[2:5]] == ["cold", "warm", "prewarm"]
    assert "TTFT ms" in lines[1] and "decode tok/s" in lines[1]
    assert lines[-1].startswith("identical tokens in every run: True")
