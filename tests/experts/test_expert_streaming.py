"""Streaming experts gives the same tokens as the fully resident mlx-lm model.

For every tested architecture, float32 and quantized, greedy and seeded sampling, at cache
budgets of one slot per layer, 10%, 50% and 100% of the experts, with a prompt that needs more
experts per layer than the small budgets hold in one pass.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import load_model

from moed.daemon.experts import StreamingConfig, install_streaming
from tests.fixtures.batch_decode import batch_tokens
from tests.fixtures.matrix import first_fast
from tests.fixtures.reference import MEMORY, SAMPLER, decode, streaming

BUDGETS = [1, "10%", "50%", "100%"]  # 1 byte: clamps to one slot per layer
# A long prompt: its chunk routes to every expert of a layer, more than a small budget holds.
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]
MAX_TOKENS = 10
CASES = [
    ("qwen3_moe", None),
    ("qwen3_moe", 4),
    ("qwen3_5_moe", None),
    ("qwen3_5_moe", 8),
    ("qwen3_next", None),
    ("deepseek_v3", None),
    ("deepseek_v3", 4),
    ("mixtral", None),
    ("olmoe", None),
    ("glm4_moe", None),
    ("gpt_oss", None),
    ("gpt_oss", 4),
]


@pytest.mark.parametrize("arch,bits", first_fast(CASES, [f"{a}-{b or 'f32'}" for a, b in CASES]))
def test_tokens_identical_to_resident(checkpoint_factory, arch, bits):
    path = checkpoint_factory(arch, bits=bits)
    resident, _ = load_model(path)
    want_greedy, want_sampled = (
        decode(resident, PROMPT, MAX_TOKENS),
        decode(resident, PROMPT, MAX_TOKENS, SAMPLER),
    )
    assert len(set(want_sampled)) > 1
    del resident

    for budget in BUDGETS:
        model, streamer = streaming(path, budget)
        try:
            snap0 = streamer.snapshot()
            assert decode(model, PROMPT, MAX_TOKENS) == want_greedy, f"greedy, budget {budget}"
            assert decode(model, PROMPT, MAX_TOKENS, SAMPLER) == want_sampled, (
                f"sampled, budget {budget}"
            )
            snap = streamer.snapshot()
        finally:
            streamer.close()
        slots, experts = snap["slots_per_layer"], snap["num_experts"]
        if budget in (1, "10%"):
            assert slots == [1] * len(slots)
        elif budget == "100%":
            assert slots == [experts] * len(slots)
            assert snap["passes"] == 0
            assert snap["misses"] <= experts * len(slots)  # each expert read once
        if slots[0] < experts:
            assert snap["passes"] > 0  # the prompt needed more experts than fit in one pass
        assert (
            2 * (len(PROMPT) + MAX_TOKENS - 1) <= snap["tokens"] <= 2 * (len(PROMPT) + MAX_TOKENS)
        )
        # every miss is cached until evicted, but those read into the pass lane
        assert snap["cached_experts"] == snap["misses"] - snap["evictions"] - snap["lane_loads"]
        assert (
            snap0["bytes_read"] == 0 and snap["bytes_read"] == snap["misses"] * snap["expert_bytes"]
        )


def test_no_stacked_experts_in_the_model(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", bits=4)
    model, streamer = streaming(path, "25%")
    try:
        assert not [n for n, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
        names = [k for k, _ in tree_flatten(model.parameters())]
        assert names and not [k for k in names if "switch_mlp" in k]
    finally:
        streamer.close()


@pytest.mark.slow
def test_stacked_experts_are_never_materialized(checkpoint_factory):
    """MLX's peak memory over load + prefill + decode stays near resident weights + slot pools
    (and the pass lane)."""
    path = checkpoint_factory("qwen3_moe", num_layers=4, num_experts=64, expert_width=256)
    # Models of the tests before this one in the process may wait in reference cycles: their
    # arrays would count in the peak (CI: 10.3 MB against 10.2, where this test alone peaks at 7.7).
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    model, streamer = streaming(path, "10%")
    try:
        decode(model, PROMPT, MAX_TOKENS)
        peak = mx.get_peak_memory()
        experts = streamer.layout.experts_bytes
        assert streamer.resident_bytes < 0.15 * experts
        # The pools and the pass lane (one more layer's slots, which the memory plan counts).
        held = streamer.resident_bytes + (streamer.lane.nbytes if streamer.lane else 0)
        assert peak < streamer.resident_weight_bytes + held + 0.1 * experts
    finally:
        streamer.close()


def test_chunked_prefill_and_mlx_lm_load_path(checkpoint_factory):
    """mlx_lm.load (the engine's path) + text generation; prefill in small chunks."""
    path = checkpoint_factory("qwen3_5_moe")
    model, tokenizer = mlx_lm.load(str(path))
    want = mlx_lm.generate(model, tokenizer, "def fibonacci(n):", max_tokens=12)
    want_chunked = decode(model, PROMPT, MAX_TOKENS, prefill_step_size=32)
    model, tokenizer = mlx_lm.load(str(path), lazy=True)
    streamer = install_streaming(
        model, path, StreamingConfig(cache_budget="25%", memory_bytes=MEMORY)
    )
    mx.eval(model.parameters())
    try:
        assert mlx_lm.generate(model, tokenizer, "def fibonacci(n):", max_tokens=12) == want
        assert decode(model, PROMPT, MAX_TOKENS, prefill_step_size=32) == want_chunked
    finally:
        streamer.close()


def test_sharded_checkpoint(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", num_layers=4, shards=3)
    assert len(list(path.glob("model-*.safetensors"))) == 3
    resident, _ = load_model(path)
    want = decode(resident, PROMPT, MAX_TOKENS)
    model, streamer = streaming(path, "50%")
    try:
        assert decode(model, PROMPT, MAX_TOKENS) == want
        assert len({t.loc.file for p in streamer.pools for t in p.tensors}) >= 2
    finally:
        streamer.close()


def test_keys_renamed_by_sanitize(checkpoint_factory, tmp_path):
    """A checkpoint whose names the model's sanitize rewrites (qwen3_5_moe with the
    Hugging Face `model.language_model.` prefix) still maps every expert tensor to its bytes."""
    import shutil

    src = checkpoint_factory("qwen3_5_moe", bits=4)
    path = tmp_path / "renamed"
    shutil.copytree(src, path)
    weights = mx.load(str(path / "model.safetensors"))

    def hf_name(k):
        if k.startswith("language_model.model."):
            return "model.language_model." + k[len("language_model.model.") :]
        return k.removeprefix("language_model.")

    mx.save_safetensors(
        str(path / "model.safetensors"),
        {hf_name(k): v for k, v in weights.items()},
        metadata={"format": "mlx"},
    )
    del weights
    resident, _ = load_model(path)
    want = decode(resident, PROMPT, MAX_TOKENS)
    model, streamer = streaming(path, "25%")
    try:
        assert streamer.paths == [
            f"language_model.model.layers.{i}.mlp.switch_mlp" for i in range(2)
        ]
        assert streamer.pools[0].tensors[0].loc.name.startswith("model.language_model.layers.0.")
        assert decode(model, PROMPT, MAX_TOKENS) == want
    finally:
        streamer.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_speculative_next_layer_prefetch_is_exact(checkpoint_factory, arch):
    """prefetch_next reads what layer L+1's router picks for layer L's input, while layer L runs."""
    path = checkpoint_factory(arch, num_layers=4, num_experts=16)
    resident, _ = load_model(path)
    want_greedy, want_sampled = (
        decode(resident, PROMPT, MAX_TOKENS),
        decode(resident, PROMPT, MAX_TOKENS, SAMPLER),
    )
    model, streamer = streaming(path, "50%", prefetch_next=True)
    try:
        assert all(r is not None for r in streamer.spec.routers)
        assert decode(model, PROMPT, MAX_TOKENS) == want_greedy
        assert decode(model, PROMPT, MAX_TOKENS, SAMPLER) == want_sampled
        snap = streamer.snapshot()
    finally:
        streamer.close()
    assert 0 < snap["prefetch_hits"] <= snap["prefetched"]
    assert snap["prefetch_hits"] + snap["prefetch_dropped"] == snap["prefetched"]
    # Every guess was read or cancelled before its read started; the used ones all were read.
    assert (
        snap["prefetch_bytes"] + snap["prefetch_cancelled_bytes"]
        == snap["prefetched"] * snap["expert_bytes"]
    )
    assert snap["prefetch_bytes"] >= snap["prefetch_hits"] * snap["expert_bytes"]
    assert snap["bytes_read"] == snap["misses"] * snap["expert_bytes"]


@pytest.mark.parametrize("mode,group_size,bits", [("mxfp4", 32, 4), ("mxfp8", 32, 8)])
def test_microscaling_quantized_experts(checkpoint_factory, tmp_path, mode, group_size, bits):
    """gpt_oss as mlx-community ships it: mxfp4 experts (uint8 scales, no quantization biases)."""
    import contextlib
    import io
    import json

    from mlx_lm.utils import quantize_model, save_config, save_model

    src = checkpoint_factory("gpt_oss")
    model, _ = load_model(src)
    with contextlib.redirect_stdout(io.StringIO()):
        model, config = quantize_model(
            model, json.loads((src / "config.json").read_text()), group_size, bits, mode=mode
        )
    path = tmp_path / mode
    save_model(path, model)
    save_config(config, path / "config.json")
    del model
    resident, _ = load_model(path)
    want = decode(resident, PROMPT, MAX_TOKENS)
    for budget in (1, "50%"):
        model, streamer = streaming(path, budget)
        try:
            assert {t.loc.dtype for t in streamer.pools[0].tensors if t.param == "scales"} == {"U8"}
            assert decode(model, PROMPT, MAX_TOKENS) == want
        finally:
            streamer.close()


def test_transformed_expert_tensors_are_refused_clearly(checkpoint_factory, tmp_path):
    """Raw Hugging Face qwen3_5_moe stores gate and up fused; sanitize slices them at load, so the
    bytes of one projection are not a tensor on disk: refuse, naming the fix."""
    import shutil

    from moed.daemon.experts import CheckpointError

    src = checkpoint_factory("qwen3_5_moe")
    path = tmp_path / "fused"
    shutil.copytree(src, path)
    weights = mx.load(str(path / "model.safetensors"))
    out = {}
    for k, v in weights.items():
        if ".switch_mlp." in k:
            continue
        out[
            "model.language_model." + k.removeprefix("language_model.model.")
            if k.startswith("language_model.model.")
            else k.removeprefix("language_model.")
        ] = v
    for i in range(2):
        p = f"language_model.model.layers.{i}.mlp.switch_mlp"
        hf = f"model.language_model.layers.{i}.mlp.experts"
        out[f"{hf}.gate_up_proj"] = mx.concatenate(
            [weights[f"{p}.gate_proj.weight"], weights[f"{p}.up_proj.weight"]], axis=1
        )
        out[f"{hf}.down_proj"] = weights[f"{p}.down_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), out, metadata={"format": "mlx"})
    model, _ = load_model(path, lazy=True)
    with pytest.raises(CheckpointError, match="mlx_lm.convert"):
        install_streaming(model, path, StreamingConfig(cache_budget="50%", memory_bytes=MEMORY))


@pytest.mark.parametrize(
    "arch,bits", [("qwen3_moe", None), ("qwen3_moe", 4), ("gpt_oss", 4), ("deepseek_v3", None)]
)
def test_a_batch_needing_more_experts_than_slots_is_exact(checkpoint_factory, arch, bits):
    """Decode steps of a 6-row batch need the union of the rows' experts per layer, more than a
    small budget's slots: the multi-pass path serves them (each row computed in the pass that
    holds its expert) with tokens identical to the resident batch."""
    path = checkpoint_factory(arch, bits=bits)

    prompts = [[17 + 29 * i] for i in range(6)]  # one token each: every step decodes all rows
    resident, _ = load_model(path)
    want = batch_tokens(resident, prompts)
    del resident
    for budget in (1, "25%"):
        model, streamer = streaming(path, budget)
        try:
            assert batch_tokens(model, prompts) == want, budget
            snap = streamer.snapshot()
        finally:
            streamer.close()
        assert snap["passes"] > 0, budget  # the union did not fit one pass
