"""The test checkpoints are real mlx-lm checkpoints: they load, route and generate."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.switch_layers import SwitchGLU
from safetensors import safe_open

from tests.fixtures.checkpoints import ARCHS, large_checkpoint_kwargs
from tests.fixtures.tokenizer import EOS_TOKEN

PROMPT = "def fibonacci(n):"

CASES = [(arch, None) for arch in ARCHS] + [("qwen3_moe", 4), ("mixtral", 4)]


def greedy_tokens(path, prompt=PROMPT, max_tokens=8, **load_kwargs) -> list[int]:
    model, tokenizer = mlx_lm.load(str(path), **load_kwargs)
    return [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
    ]


def switch_glus(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, SwitchGLU)]


def tensors_by_file(path) -> dict[str, dict[str, tuple]]:
    """{file name: {tensor name: (dtype, shape)}} read from the safetensors headers."""
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            slices = {k: st.get_slice(k) for k in st.keys()}
            out[f.name] = {k: (s.get_dtype(), s.get_shape()) for k, s in slices.items()}
    return out


@pytest.mark.parametrize("arch,bits", CASES, ids=[f"{a}-{b or 'f32'}" for a, b in CASES])
def test_checkpoint_loads_and_generates_deterministically(checkpoint_factory, arch, bits):
    path = checkpoint_factory(arch, bits=bits)
    model, tokenizer = mlx_lm.load(str(path))
    prefixes = tuple(name + "." for name in switch_glus(model))
    assert prefixes

    first = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=8)]
    assert len(first) >= 1
    assert greedy_tokens(path) == first  # a fresh load gives the same greedy tokens

    # Stacked, sanitized expert tensors on disk, as in mlx-community checkpoints.
    files = tensors_by_file(path)
    assert list(files) == ["model.safetensors"]
    experts = {k: v for k, v in files["model.safetensors"].items() if k.startswith(prefixes)}
    assert experts, "no stacked expert tensors"
    for name, (dtype, shape) in experts.items():
        assert shape[0] == 8, name  # (num_experts, out, in); gpt_oss biases (num_experts, out)
        assert len(shape) == (3 if name.endswith((".weight", ".scales", ".biases")) else 2), name
        if bits is None:
            assert dtype == "F32", name
    if bits is not None:
        config = json.loads((path / "config.json").read_text())
        assert config["quantization"]["bits"] == bits
        assert any(k.endswith("gate_proj.scales") for k in experts)


def test_sharded_checkpoint_matches_single_file(checkpoint_factory):
    single = checkpoint_factory("qwen3_moe", seed=1)
    sharded = checkpoint_factory("qwen3_moe", seed=1, shards=2)

    files = tensors_by_file(sharded)
    assert list(files) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {k: f for f, ts in files.items() for k in ts}
    wm = index["weight_map"]
    assert (
        wm["model.layers.0.mlp.switch_mlp.up_proj.weight"]
        != wm["model.layers.1.mlp.switch_mlp.up_proj.weight"]
    )

    tokens = greedy_tokens(single)
    assert greedy_tokens(sharded) == tokens
    assert greedy_tokens(sharded, lazy=True) == tokens


def test_dense_first_layer_and_three_shards(checkpoint_factory):
    # DeepSeek-style: layer 0 is dense, layers 1-2 are MoE, each layer in its own file.
    path = checkpoint_factory("deepseek_v3", num_layers=3, shards=3)
    model, tokenizer = mlx_lm.load(str(path))
    assert sorted(switch_glus(model)) == [
        "model.layers.1.mlp.switch_mlp",
        "model.layers.2.mlp.switch_mlp",
    ]
    files = tensors_by_file(path)
    assert len(files) == 3
    assert len(list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=4))) >= 1


def test_seed_changes_weights_and_routing_varies(checkpoint_factory, tiny_model):
    other = checkpoint_factory("qwen3_moe", seed=7)
    a = mx.load(str(tiny_model / "model.safetensors"))
    b = mx.load(str(other / "model.safetensors"))
    key = "model.layers.0.mlp.switch_mlp.gate_proj.weight"
    assert not mx.array_equal(a[key], b[key])

    # Different tokens pick different experts (the router is not degenerate).
    model, tokenizer = mlx_lm.load(str(tiny_model))
    ids = mx.array(tokenizer.encode("the capital of France is Paris; print(fibonacci(10))"))
    x = model.model.embed_tokens(ids)
    layer = model.model.layers[0]
    gates = layer.mlp.gate(layer.post_attention_layernorm(x))
    top = mx.argpartition(-gates, kth=1, axis=-1)[:, :2]
    assert len(set(top.reshape(-1).tolist())) >= 6


def test_tokenizer_chat_template_and_eos(tiny_model):
    _, tokenizer, config = mlx_lm.load(str(tiny_model), return_config=True)
    assert tokenizer.eos_token == EOS_TOKEN
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert config["vocab_size"] == len(tokenizer.get_vocab())
    text = "def f(x):\n    return x + 1  # ünïcode"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_large_checkpoint_kwargs_size():
    kw = large_checkpoint_kwargs(300)
    per_expert = 3 * kw["hidden"] * kw["expert_width"] * 4
    total_mb = per_expert * kw["num_experts"] * kw["num_layers"] / 2**20
    assert 250 <= total_mb <= 350
