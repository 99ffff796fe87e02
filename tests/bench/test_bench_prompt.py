"""`moed bench prompt` at toy scale: a real streaming model at each chunk size, the JSON report's
shape, no expert read twice in a pass, fewer bytes per prompt token for larger chunks, and the
first token bit-identical to the resident model's."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.daemon_harness import moed

pytestmark = pytest.mark.process


def test_bench_prompt_json_and_table(tiny_model, tmp_path):
    out_file = tmp_path / "prompt.json"
    out = moed(
        "bench", "prompt", "--model", str(tiny_model), "--prompt-tokens", "120",
        "--budget", "1", "--chunks", "8,32,plan", "--json", str(out_file),
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "KB/prompt tok" in out.stdout and "(plan)" in out.stdout
    report = json.loads(out_file.read_text())
    runs = report["runs"]
    assert [r["chunk"] for r in runs[:2]] == [8, 32] and runs[2]["label"] == "plan"
    assert all(0 < r["reads"] <= r["distinct"] for r in runs)
    # Read as the daemon reads it, the first token is the resident model's, to the bit.
    assert all(r["same"] is True and r["resident_seconds"] > 0 for r in runs)
    per_token = [r["bytes_per_prompt_token"] for r in runs]
    assert per_token[0] > per_token[1] >= per_token[2] > 0
