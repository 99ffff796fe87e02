"""`moed plan`: the daemon's memory plan from a config.json alone, the decode hit rate at the
plan's cache share replayed on recorded routing, and the projections, marked as such."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from moed.daemon.bench.plan import parse_memory, plan
from moed.daemon.bench.plan_model import Inputs, model_shape, plan_row
from moed.daemon.bench.published_models import PublishedModel
from moed.daemon.bench.replica_layout import EXPERT_TENSOR, text_tensors
from moed.daemon.experts.policies import make_policy
from moed.daemon.telemetry.analyze import simulate
from moed.daemon.telemetry.routing import decode_hit_rate, read_routing

DEMO_TRACE = Path(__file__).parents[2] / "benchmarks" / "traces" / "code-fib-greedy.moetrace"
GiB = 2**30


def test_memory_sizes_are_read_as_macs_are_sold():
    assert parse_memory("16GB, 24gb,32,1.5GiB") == [16 * GiB, 24 * GiB, 32 * GiB, int(1.5 * GiB)]
    for bad in ("16TB", "0GB", "lots"):
        with pytest.raises(Exception, match="not a memory size"):
            parse_memory(bad)


def test_shape_from_the_config_alone():
    config = PublishedModel.QWEN36_35B_A3B.config()
    shape = model_shape("35b", config)
    assert (shape.layers, shape.experts, shape.top_k) == (40, 256, 8)
    assert shape.expert_bytes == 1_769_472 and shape.layout.experts_bytes == 40 * 256 * 1_769_472
    text = text_tensors(config)
    resident = sum(s.nbytes for s in text if not EXPERT_TENSOR.search(s.name))
    assert shape.resident_bytes == resident  # the vision tower (never loaded) is not planned
    assert not any(s.name.startswith("vision_tower") for s in text)
    big = model_shape("122b", PublishedModel.QWEN35_122B_A10B.config())
    assert (big.layers, big.experts) == (48, 256)
    assert big.expert_bytes == 3 * (1024 * 3072 // 2 + 2 * 2 * 1024 * 3072 // 64)
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        dense = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2}
        model_shape("dense", dense)


def test_simulate_can_leave_the_prompt_uncounted():
    calls = [np.array([0, 1, 2]), np.array([1, 2, 3])]
    policy = make_policy("lru", 4, 4)
    assert simulate(calls, 4, policy, counted=[False, True]) == (2, 1)
    assert simulate(calls, 4, make_policy("lru", 4, 4)) == (2, 4)


def test_route_lines_become_the_daemons_passes(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    rows = [
        {"model": "m", "layers": 2, "experts": 8, "top_k": 2},
        {"prompt": 0, "pos": 0, "phase": "prefill", "experts": [[0, 1], []]},
        {"prompt": 0, "pos": 1, "phase": "prefill", "experts": [[1, 2], [3, 4]]},
        {"prompt": 0, "pos": 2, "phase": "decode", "experts": [[0, 2], [3, 5]]},
        {"prompt": 0, "pos": 3, "phase": "decode", "experts": [[6, 2], [4, 3]]},
    ]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    routing = read_routing(path)
    assert routing.prompt == [True, False, False] and routing.decode_tokens == 2
    assert [c.tolist() for c in routing.calls[0]] == [[0, 1, 2], [0, 2], [2, 6]]
    assert [c.tolist() for c in routing.calls[1]] == [[3, 4], [3, 5], [3, 4]]
    # Everything held: the decode tokens miss only what the prompt did not read (5, then 6).
    hits, lookups = decode_hit_rate(routing, 1.0)
    assert (hits, lookups) == (6, 8)


def test_more_memory_plans_a_larger_budget_and_projects_more(tmp_path):
    shape = model_shape("122b", PublishedModel.QWEN35_122B_A10B.config())
    routing = [read_routing(DEMO_TRACE)]
    inputs = Inputs()
    rows = [plan_row(shape, m * GiB, routing, inputs, 400 << 20) for m in (16, 32, 64, 128)]
    assert all(r.plan.fits for r in rows)
    shares = [r.share for r in rows]
    assert shares == sorted(shares) and shares[0] < 0.5 and shares[-1] == 1.0
    rates = [r.hit_rate for r in rows]
    assert rates == sorted(rates) and rates[-1] == 1.0
    slow, fast = inputs.ssd_bandwidths
    for r in rows[:-1]:  # streaming: a faster SSD projects more tokens
        assert r.bytes_per_token > 0 and r.projected_tok_s[fast] > r.projected_tok_s[slow]
    held = rows[-1]  # every expert held: nothing read, routed on the device
    assert held.bytes_per_token == 0 and held.projected_tok_s[slow] == held.projected_tok_s[fast]
    tiny = plan_row(shape, 4 * GiB, routing, inputs, 400 << 20)
    assert not tiny.plan.fits and tiny.projected_tok_s == {}


def test_plan_command_marks_every_projection(tmp_path):
    args = ["qwen3.6-35b-a3b-4bit", "--memory", "16GB,64GB", "--trace", str(DEMO_TRACE)]
    result = CliRunner().invoke(plan, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "projected tok/s @3 GB/s" in result.output and "projected tok/s @6 GB/s" in result.output
    assert "projected: not measured on these machines" in result.output
    assert "mlx-community/Qwen3.6-35B-A3B-4bit" in result.output
    result = CliRunner().invoke(plan, [*args, "--json", "--ssd", "4"], catch_exceptions=False)
    report = json.loads(result.output)
    assert report["projected"] is True and report["inputs"]["ssd_bandwidths"] == [4e9]
    (model,) = report["models"]
    assert [r["memory_bytes"] for r in model["rows"]] == [16 * GiB, 64 * GiB]
    assert list(model["rows"][0]["projected_tok_s"]) == ["4GB/s"]
    assert model["rows"][1]["share"] == 1.0 and model["rows"][1]["hit_rate"] == 1.0
    # A folder or a config.json works as well as a published name.
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PublishedModel.QWEN35_122B_A10B.config()))
    result = CliRunner().invoke(plan, [str(tmp_path), "--memory", "64", "--trace", str(DEMO_TRACE)])
    assert result.exit_code == 0 and "48 MoE layers" in result.output


def test_plan_command_refuses_what_it_cannot_plan(tmp_path):
    result = CliRunner().invoke(plan, [str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "no readable config.json" in result.output
    result = CliRunner().invoke(plan, ["qwen3.6-35b-a3b-4bit", "--memory", "16TB"])
    assert result.exit_code == 2 and "not a memory size" in result.output
