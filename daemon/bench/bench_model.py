"""The generated benchmark checkpoint of `moed bench stream`: Qwen3.6-35B-A3B expert shapes
(hidden 2048, expert width 512, 256 experts, top-8, 4-bit) in a few layers, expert tensors written
directly in the quantized layout so the full-precision experts never exist in memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast


def bench_config(
    layers: int,
    hidden: int,
    width: int,
    experts: int,
    top_k: int,
    vocab: int,
    bits: int,
    group: int,
) -> dict:
    heads = max(2, hidden // 128)
    quant: dict[str, Any] = {"group_size": group, "bits": bits}
    for i in range(layers):
        quant[f"model.layers.{i}.mlp.gate"] = {
            "group_size": 64,
            "bits": 8,
        }  # routers stay 8-bit, as mlx-lm converts them
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 4 * width,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 8),
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": width,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
        "norm_topk_prob": True,
        "quantization": quant,
        "quantization_config": quant,
    }


def write_bench_model(dest: Path, config: dict, dtype: str, seed: int = 0) -> Path:
    """Non-expert weights from the mlx-lm model class; expert tensors written directly in the
    quantized layout (random packed weights, scales and biases), one shard per layer, so the
    full-precision experts never exist in memory."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_moe

    dest.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    mx_dtype = getattr(mx, dtype)
    quant = config["quantization"]
    bits, group = quant["bits"], quant["group_size"]
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))  # bench_config is qwen3_moe

    def predicate(path, module):
        if "switch_mlp" in path or not hasattr(module, "to_quantized"):
            return False
        return quant.get(path, True)

    # The stacked experts' random init stays a lazy graph that is never evaluated.
    nn.quantize(model, group_size=group, bits=bits, class_predicate=predicate)
    # tree_flatten is typed as a list or a dict; without a `destination` it is the list.
    flat = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    resident = {k: v for k, v in flat if ".switch_mlp." not in k}
    resident = {
        k: (v.astype(mx_dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in resident.items()
    }
    mx.eval(resident)

    layers = config["num_hidden_layers"]
    E, H, W = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    shards = layers
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map: dict[str, str] = {}
    total = 0
    per_word = 32 // bits
    for layer in range(layers):
        tensors: dict[str, mx.array] = {}
        if layer == 0:
            tensors.update({k: v for k, v in resident.items() if ".layers." not in k})
        tensors.update({k: v for k, v in resident.items() if f".layers.{layer}." in k})
        for proj, (out_dim, in_dim) in (
            ("gate_proj", (W, H)),
            ("up_proj", (W, H)),
            ("down_proj", (H, W)),
        ):
            prefix = f"model.layers.{layer}.mlp.switch_mlp.{proj}"
            packed = rng.integers(0, 2**32, size=(E, out_dim, in_dim // per_word), dtype=np.uint32)
            # Dequantized weights ~ uniform(-1/sqrt(in), 1/sqrt(in)) with a little spread per group.
            levels = 2**bits - 1
            scale = (2.0 / (levels * np.sqrt(in_dim))) * (
                1.0 + 0.1 * rng.standard_normal((E, out_dim, in_dim // group), dtype=np.float32)
            )
            tensors[f"{prefix}.weight"] = mx.array(packed)
            tensors[f"{prefix}.scales"] = mx.array(scale.astype(np.float32)).astype(mx_dtype)
            tensors[f"{prefix}.biases"] = mx.array(
                (-levels / 2.0 * scale).astype(np.float32)
            ).astype(mx_dtype)
            del packed, scale
        mx.eval(tensors)
        mx.save_safetensors(str(dest / names[layer]), tensors, metadata={"format": "mlx"})
        for k, v in tensors.items():
            weight_map[k] = names[layer]
            total += v.nbytes
        del tensors
    (dest / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2,
        )
    )
    cfg = dict(config)
    cfg["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return dest


def _same_config(path: Path, config: dict, dtype: str) -> bool:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return saved == {**config, "torch_dtype": dtype}
