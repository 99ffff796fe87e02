"""The embedded demo model: loads with plain mlx-lm, writes Python, routes non-uniformly.

Streaming at a quarter of the experts must reproduce the resident tokens exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from moed.daemon.experts import StreamingConfig, install_streaming
from moed.daemon.model.demo import demo_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the training/ scripts
from training.routing_stats import greedy_routes, layer_stats, uniform_baseline  # noqa: E402

MAX_BYTES = 20 * 1000 * 1000


@pytest.fixture(scope="module")
def demo():
    return mlx_lm.load(str(demo_model_path()))


def test_checkpoint_is_stock_and_small():
    path = demo_model_path()
    files = {f.name: f.stat().st_size for f in path.iterdir() if f.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        files
    )
    assert sum(files.values()) <= MAX_BYTES
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert 16 <= config["num_experts"] <= 64 and 2 <= config["num_experts_per_tok"] <= 8
    names = mx.load(str(path / "model.safetensors")).keys()
    assert "model.layers.0.mlp.switch_mlp.gate_proj.weight" in names


def test_fibonacci_continuation_looks_like_python(demo):
    model, tokenizer = demo
    text = mlx_lm.generate(model, tokenizer, "def fibonacci(n):", max_tokens=30)
    body = text.splitlines()
    # The body starts on a new, indented line and uses Python keywords.
    assert text.startswith("\n"), text
    assert any(line.startswith("    ") and line.strip() for line in body), text
    assert any(kw in text for kw in ("return", "if ", "for ", "def ", "self", "=", '"""')), text


def test_chat_template_renders_the_prompt(demo):
    _, tokenizer = demo
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "import os"}], add_generation_prompt=True
    )
    assert tokenizer.decode(ids) == "import os"


@pytest.mark.slow
def test_routing_is_not_uniform(demo):
    model, tokenizer = demo
    block = model.layers[0].mlp
    base = uniform_baseline(block.num_experts, block.top_k, 150, trials=50)
    _, routes = greedy_routes(model, tokenizer, "def fibonacci(n):", 150)
    stats = [layer_stats(r, block.num_experts) for r in routes]
    assert all(len(r) == 150 for r in routes)
    mean_unique = sum(s.unique for s in stats) / len(stats)
    assert mean_unique < base.unique - 1, [s.unique for s in stats]
    assert sum(s.top_share for s in stats) / len(stats) > base.top_share, stats
    # Consecutive tokens share experts more often than k/E, the uniform expectation.
    uniform_reuse = block.top_k / block.num_experts
    assert sum(s.reuse for s in stats) / len(stats) > 1.5 * uniform_reuse, stats


def _greedy(model, prompt_ids, n=40) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n)]


@pytest.mark.slow
def test_streaming_quarter_budget_reproduces_resident_tokens(demo):
    model, tokenizer = demo
    prompt = tokenizer.encode("class Queue:\n    def __init__(self, maxsize=0):")
    want = _greedy(model, prompt)

    path = demo_model_path()
    lazy, _ = mlx_lm.load(str(path), lazy=True)
    cfg = StreamingConfig(cache_budget="25%", memory_bytes=8 << 30)
    streamer = install_streaming(lazy, path, cfg)
    mx.eval(lazy.parameters())
    try:
        assert _greedy(lazy, prompt) == want
        snap = streamer.snapshot()
        assert snap["slots_per_layer"][0] < snap["num_experts"]
    finally:
        streamer.close()
