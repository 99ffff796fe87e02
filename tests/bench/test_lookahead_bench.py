"""`moed bench stream --look-budgets` (idle-disk lookahead beside the same budget without it, and
the predictor's recall per layer) and `moed bench recall` (routing-only predictors on a trace)."""

from __future__ import annotations

import gzip
import json

from click.testing import CliRunner

from moed.daemon.bench.recall import recall, routing_recall
from moed.daemon.bench.stream import stream


def test_routing_recall_counts_what_each_predictor_found():
    same = [[{0}, {1}]] * 3
    assert routing_recall(same, experts=4, top_k=1) == {
        "reuse": [(2, 2), (2, 2)],  # the first token has nothing before it
        "co-occurrence": [(0, 0), (2, 2)],  # layer 0 has no layer before
    }
    # Layer 1 moves from expert 1 to 2: the token before and what followed expert 0 both say 1.
    moved = [[{0}, {1}], [{0}, {2}]]
    assert routing_recall(moved, experts=4, top_k=1) == {
        "reuse": [(1, 1), (0, 1)],
        "co-occurrence": [(0, 0), (0, 1)],
    }


def test_bench_recall_reads_a_route_trace(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    lines = [{"model": "toy", "layers": 2, "experts": 4, "top_k": 1}]
    lines.append({"prompt": 0, "pos": 0, "phase": "prefill", "experts": [[3], [2]]})
    lines += [
        {"prompt": 0, "pos": p, "phase": "decode", "experts": [[0], [1]]} for p in range(1, 5)
    ]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(line) for line in lines) + "\n")
    result = CliRunner().invoke(recall, [str(path)])
    assert result.exit_code == 0, result.output
    assert "2 layers x 4 experts, top-1; 4 decode tokens" in result.output
    reuse = next(line for line in result.output.splitlines() if "reuse" in line)
    assert reuse.split()[-2:] == ["mean", "100%"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"model": "x"}\n')
    assert CliRunner().invoke(recall, [str(bad)]).exit_code == 2


def test_bench_stream_lookahead_rows(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--layers", "3", "--hidden", "128", "--expert-width", "64", "--experts", "16"]
    args += ["--top-k", "4", "--vocab", "512", "--tokens", "8", "--warmup", "4"]
    args += ["--raw-sample-mb", "2", "--budgets", "25%", "--look-budgets", "25%"]
    args += ["--spec-budgets", "", "--active-experts", "", "--no-preloaded"]
    args += ["--model-dir", str(tmp_path / "model"), "--json", str(out)]
    result = CliRunner().invoke(stream, args)
    assert result.exit_code == 0, result.output
    text = result.output
    assert "25%+look vs 25%: tok/s x" in text and "same tokens: yes" in text
    assert "gate (next router, this input)" in text and "reuse (same run)" in text
    data = json.loads(out.read_text())
    runs = {r["name"]: r for r in data["runs"]}
    plain, look = runs["25%"], runs["25%+look"]
    assert look["tokens"] == plain["tokens"] == data["resident"]["tokens"]
    la, c = look["lookahead"], look["counters"]
    assert 0 <= la["lookahead_served"] <= la["lookahead_guessed"]
    # Every miss was read on demand or served from the lane, never both.
    assert c["bytes_read"] + la["lookahead_served_bytes"] == c["misses"] * look["expert_bytes"]
    gate = la["lookahead_recall"]
    assert gate[0] == [0, 0] and all(0 <= f <= w for f, w in gate) and gate[1][1] > 0
