"""`moed bench replica`: the layout of mlx-community/Qwen3.6-35B-A3B-4bit, written with random
weights, loads in plain mlx-lm, streams to the same tokens as the resident model, and carries
Qwen3.6's tokenizer and chat template.

The layout tests read the full 40-layer model's shapes (no weights written); the loading and
decoding tests write the same model narrowed (hidden 256, experts of width 128; `narrowed`, for
tests only) at 4 layers, since the published widths cost ~3 GB and seconds of CPU a token here.
Decoding runs on a float32 copy (`--dtype float32`: MLX's CPU backend runs bfloat16 several
times slower); loading and the tokenizer on the bfloat16 one. The `slow` test runs the published
widths at `--layers 4`.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from moed.daemon.bench.published_models import (
    PublishedModel,
    ReplicaConfigError,
    narrowed,
    shallower,
)
from moed.daemon.bench.replica import bench_replica, write_replica
from moed.daemon.bench.replica_layout import Dtype, replica_tensors
from moed.daemon.bench.replica_tokenizer import control_id
from moed.daemon.bench.replica_values import bfloat16_bits, values
from moed.daemon.bench.shard_writer import SHARD_BYTES, plan_shards
from moed.daemon.engine.reasoning import initial_channel
from moed.daemon.engine.tool_calls import ToolCalls
from moed.daemon.engine.tool_grammar import CallFormat, call_format
from moed.protocol import Channel
from tests.fixtures.reference import decode, resident, streaming

NARROW = dict(hidden_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128)
PROMPT = [(37 * i + 11) % 240_000 + 500 for i in range(24)]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def _narrow_replica(tmp_path_factory, floats: Dtype):
    config = narrowed(shallower(PublishedModel.QWEN36_35B_A3B.config(), 4), **NARROW)
    path = tmp_path_factory.mktemp(f"replica-{floats.value}")
    write_replica(path, config, seed=0, floats=floats)
    return path


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """The narrowed 4-layer replica, bfloat16 as published."""
    return _narrow_replica(tmp_path_factory, Dtype.BF16)


@pytest.fixture(scope="module")
def replica_f32(tmp_path_factory):
    """The same in float32, for decoding on the CPU."""
    return _narrow_replica(tmp_path_factory, Dtype.F32)


def test_full_scale_layout_is_the_published_one():
    config = PublishedModel.QWEN36_35B_A3B.config()
    specs = {s.name: s for s in replica_tensors(config)}
    text = config["text_config"]
    assert (text["num_hidden_layers"], text["num_experts"], text["num_experts_per_tok"]) == (
        40,
        256,
        8,
    )
    # Every layer: routed experts stacked (256, out, in/8) in uint32 with bf16 scales/biases.
    gate = "language_model.model.layers.{}.mlp.switch_mlp.gate_proj.{}"
    assert specs[gate.format(0, "weight")].shape == (256, 512, 2048 // 8)
    assert specs[gate.format(39, "scales")].shape == (256, 512, 2048 // 64)
    assert specs[gate.format(39, "scales")].dtype is Dtype.BF16
    down = "language_model.model.layers.7.mlp.switch_mlp.down_proj.weight"
    assert specs[down].shape == (256, 2048, 512 // 8) and specs[down].dtype is Dtype.U32
    # The routers and shared-expert gates at 8 bits, as the quantization block says.
    assert specs["language_model.model.layers.5.mlp.gate.weight"].shape == (256, 2048 // 4)
    assert specs["language_model.model.layers.5.mlp.shared_expert_gate.weight"].shape == (1, 512)
    assert config["quantization"]["language_model.model.layers.39.mlp.gate"]["bits"] == 8
    # 30 gated-delta layers, 10 full attention (every 4th), as layer_types says.
    layer = "language_model.model.layers.{}.{}"
    linear = [i for i in range(40) if layer.format(i, "linear_attn.A_log") in specs]
    full = [i for i in range(40) if layer.format(i, "self_attn.q_proj.weight") in specs]
    assert full == [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"]
    assert (len(linear), len(full)) == (30, 10) and full[:2] == [3, 7]
    assert specs["language_model.model.layers.0.linear_attn.A_log"].dtype is Dtype.F32
    # One 4-bit expert is 1.77 MB (weights, scales, biases of its three projections).
    per_expert = sum(
        math.prod(s.shape[1:]) * s.dtype.itemsize
        for n, s in specs.items()
        if ".layers.0.mlp.switch_mlp." in n
    )
    assert per_expert == 3 * (512 * 2048 // 2 + 2 * 2 * 512 * 2048 // 64) == 1_769_472
    experts = sum(s.nbytes for n, s in specs.items() if ".switch_mlp." in n)
    assert experts == 40 * 256 * per_expert
    assert sum(1 for n in specs if n.startswith("vision_tower.")) == 333
    total = sum(s.nbytes for s in specs.values())
    assert 20.0e9 < total < 20.8e9  # the published conversion is ~20 GB
    shards = plan_shards(list(specs.values()))
    assert len(shards) == math.ceil(total / SHARD_BYTES)
    assert all(s.nbytes <= SHARD_BYTES for s in shards)


def test_the_122b_config_is_the_published_family():
    config = PublishedModel.QWEN35_122B_A10B.config()
    text = config["text_config"]
    assert config["model_type"] == "qwen3_5_moe"
    assert (text["num_hidden_layers"], text["hidden_size"], text["moe_intermediate_size"]) == (
        48,
        3072,
        1024,
    )
    assert text["layer_types"].count("full_attention") == 12
    assert sum(1 for k in config["quantization"] if k.endswith(".mlp.gate")) == 48


def test_shallower_keeps_the_layer_pattern_and_overrides():
    config = shallower(PublishedModel.QWEN36_35B_A3B.config(), 8)
    text = config["text_config"]
    assert text["num_hidden_layers"] == 8
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    overrides = [k for k in config["quantization"] if k.startswith("language_model.")]
    assert len(overrides) == 16 and config["quantization_config"] == config["quantization"]
    for layers in (3, 41):
        with pytest.raises(ReplicaConfigError):
            shallower(PublishedModel.QWEN36_35B_A3B.config(), layers)


def test_values_keep_weights_zero_mean_and_scaled():
    config = narrowed(shallower(PublishedModel.QWEN36_35B_A3B.config(), 4), **NARROW)
    specs = {s.name: s for s in replica_tensors(config)}
    scales = specs["language_model.model.layers.0.mlp.switch_mlp.up_proj.scales"]
    biases = specs["language_model.model.layers.0.mlp.switch_mlp.up_proj.biases"]
    n = 4096
    s = _bf16(values(scales, 3, 0, n))
    b = _bf16(values(biases, 3, 0, n))
    np.testing.assert_allclose(b, -7.5 * s, rtol=2e-2)  # each group's codes centred on zero
    code_std = math.sqrt((16**2 - 1) / 12)
    assert abs(float(np.mean(s)) * code_std * math.sqrt(256) - 1.0) < 0.02
    assert np.ptp(s) > 0  # jittered per group
    # A chunk is the same whether made alone or inside a larger one.
    packed = specs["language_model.model.layers.0.mlp.switch_mlp.up_proj.weight"]
    assert np.array_equal(values(packed, 3, 100, 50), values(packed, 3, 100, 50))
    assert _bf16(bfloat16_bits(np.array([1.0, -0.5, 3.0], np.float32))).tolist() == [1, -0.5, 3]


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def test_shards_are_safetensors_with_the_written_values(replica):
    index = json.loads((replica / "model.safetensors.index.json").read_text())
    name = "language_model.model.layers.2.mlp.switch_mlp.down_proj.weight"
    config = json.loads((replica / "config.json").read_text())
    spec = next(s for s in replica_tensors(config) if s.name == name)
    with safe_open(str(replica / index["weight_map"][name]), framework="numpy") as f:
        stored = f.get_tensor(name)
    assert stored.dtype == np.uint32 and stored.shape == spec.shape
    assert np.array_equal(stored.reshape(-1)[:1000], values(spec, 0, 0, 1000))
    assert index["metadata"]["total_size"] == sum(
        p.stat().st_size for p in replica.glob("model*.safetensors")
    ) - sum(_header_bytes(p) for p in replica.glob("model*.safetensors"))


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_shards_written_side_by_side_hold_the_same_bytes(tmp_path):
    small = dict(hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    config = narrowed(shallower(PublishedModel.QWEN36_35B_A3B.config(), 4), **small)
    one = write_replica(tmp_path / "one", config, shard_bytes=20 << 20, workers=1)
    two = write_replica(tmp_path / "two", config, shard_bytes=20 << 20, workers=2)
    assert one.shards == two.shards > 2
    for shard in sorted((tmp_path / "one").glob("model-*.safetensors")):
        assert shard.read_bytes() == (tmp_path / "two" / shard.name).read_bytes()
    index = json.loads((tmp_path / "two" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == two.shards


def test_replica_loads_in_plain_mlx_lm(replica):
    model, tokenizer = mlx_lm.load(str(replica))  # strict: every tensor named and shaped as asked
    layers = model.language_model.model.layers
    assert len(layers) == 4 and [layer.is_linear for layer in layers] == [True, True, True, False]
    logits = model(mx.array([PROMPT[:2]]))
    assert bool(mx.all(mx.isfinite(logits)))
    assert logits.shape == (1, 2, 248_320)
    assert tokenizer.eos_token_ids == {control_id("<|im_end|>"), control_id("<|endoftext|>")}


def test_streaming_matches_resident_at_25_and_10_percent(replica_f32):
    want = decode(resident(replica_f32), PROMPT, 8)
    for budget in ("25%", "10%"):
        model, streamer = streaming(replica_f32, budget)
        try:
            assert decode(model, PROMPT, 8) == want, budget
            snap = streamer.snapshot()
        finally:
            streamer.close()
        assert snap["slots_per_layer"] == [64 if budget == "25%" else 25] * 4
        # Routing is spread: the prompt alone needs more distinct experts than a 10% cache holds.
        assert snap["passes"] > 0 and snap["misses"] > snap["slots_per_layer"][0] * 4
    assert len(set(want)) > 1


def test_tokenizer_renders_qwen36_template_with_tools_and_thinking(replica):
    _, tokenizer = mlx_lm.load(str(replica), lazy=True)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "A tool knows.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access")
    assert json.dumps(TOOLS[0]) in text and text.count("You are terse.") == 1
    assert (
        "<|im_start|>assistant\n<think>\nA tool knows.\n</think>\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ) in text
    off = tokenizer.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The real ids of Qwen3.5/3.6's control tokens.
    for token, real in (
        ("<|im_start|>", 248045),
        ("<|im_end|>", 248046),
        ("<tool_call>", 248058),
        ("</tool_call>", 248059),
        ("<think>", 248068),
        ("</think>", 248069),
    ):
        assert tokenizer.convert_tokens_to_ids(token) == real
        assert real in ids or token == "</tool_call>" and 248059 in ids
    # moed's engine sees the XML tool format and the think markers.
    assert call_format(tokenizer) is CallFormat.QWEN_XML
    assert tokenizer.has_thinking and tokenizer.think_start == "<think>"
    assert initial_channel(tokenizer, ids) is Channel.REASONING
    calls = ToolCalls(tokenizer, TOOLS)
    shown, made = calls.feed(
        "Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert shown == "Let me check."
    assert [(c["name"], c["arguments"]) for c in made] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]


def test_command_refuses_a_layer_count_without_full_attention(tmp_path):
    result = CliRunner().invoke(bench_replica, [str(tmp_path / "r"), "--layers", "3"])
    assert result.exit_code == 2 and "--layers" in result.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    result = CliRunner().invoke(bench_replica, [str(tmp_path / "busy"), "--layers", "4"])
    assert result.exit_code == 1 and "not touched" in result.output
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_published_widths_stream_to_the_resident_tokens(tmp_path):
    """The published shapes at --layers 4 (float32 for the CPU backend): ~4.5 GB, minutes."""
    path = tmp_path / "replica"
    result = CliRunner().invoke(
        bench_replica, [str(path), "--layers", "4", "--dtype", "float32"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    prompt = PROMPT[:8]
    want = decode(resident(path), prompt, 4)
    for budget in ("25%", "10%"):
        model, streamer = streaming(path, budget)
        try:
            assert decode(model, prompt, 4) == want, budget
        finally:
            streamer.close()


@pytest.mark.process
def test_moed_serve_streams_the_replica(replica_f32, daemon_factory):
    """A real daemon on the replica at 25%: the tool format and think markers it reports, and the
    resident model's greedy tokens."""
    from moed.client import DoneEvent, TokenEvent
    from tests.fixtures.reference import generate

    d = daemon_factory(replica_f32, "--cache-budget", "25%")
    got, done = [], None
    with d.client() as c:
        for event in c.generate("def fibonacci(n):", max_tokens=6, raw=True):
            if isinstance(event, TokenEvent):
                got += event.ids
            elif isinstance(event, DoneEvent):
                done = event
    assert got == generate(replica_f32, "def fibonacci(n):", 6)
    assert done is not None and done.usage["completion_tokens"] == len(got)


def test_the_daemons_plan_leaves_the_vision_tower_out(replica):
    """The daemon plans from the checkpoint's index, `moed plan` from its config: the same
    experts and resident weights, the vision tower (stored, never loaded) in neither."""
    from moed.daemon.bench.plan_model import model_shape
    from moed.daemon.experts.memory_plan import layout_from_index, resident_bytes
    from moed.daemon.experts.safetensors_index import CheckpointIndex

    index = CheckpointIndex(replica)
    vision = sum(t.nbytes for n, t in index.tensors.items() if n.startswith("vision_tower."))
    assert vision > 0
    layout = layout_from_index(index)
    shape = model_shape("replica", json.loads((replica / "config.json").read_text()))
    assert (layout.expert_bytes, layout.num_experts) == (
        shape.layout.expert_bytes,
        shape.layout.num_experts,
    )
    assert resident_bytes(index, layout) == shape.resident_bytes
    assert index.total_bytes == shape.resident_bytes + layout.experts_bytes + vision
