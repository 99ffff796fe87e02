"""A checkpoint's config.json is read once into ModelConfig: the text config's nesting resolved,
the MoE shape under every architecture's own key names, quantization and context."""

from __future__ import annotations

import json

import pytest

from moed.protocol.model_config import ModelConfig
from tests.fixtures.checkpoints import ARCHS, make_config


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_gives_its_moe_shape(arch):
    config = ModelConfig.from_dict(make_config(arch, num_layers=3, top_k=2, vocab=99))
    assert config.model_type == arch
    assert (config.num_experts, config.experts_per_token) == (8, 2)
    assert config.num_layers == 3 and config.vocab_size == 99 and config.hidden_size == 64
    assert config.is_moe


def test_the_nested_text_config_wins_and_the_top_level_fills_in():
    config = ModelConfig.from_dict(
        {
            "model_type": "qwen3_5_moe",
            "vocab_size": 10,
            "torch_dtype": "bfloat16",
            "quantization": {"group_size": 64, "bits": 4},
            "text_config": {
                "model_type": "qwen3_5_moe_text",
                "vocab_size": 248320,
                "max_position_embeddings": 262144,
                "num_experts": 256,
                "num_experts_per_tok": 8,
            },
        }
    )
    assert config.model_type == "qwen3_5_moe"  # the architecture mlx-lm loads, not the text's
    assert config.vocab_size == 248320 and config.context_tokens == 262144
    assert config.text["num_experts_per_tok"] == 8 and config.text["torch_dtype"] == "bfloat16"
    assert config.quantization == {"group_size": 64, "bits": 4}
    assert config.raw["vocab_size"] == 10  # the file as written, for mlx-lm


def test_the_dtype_of_a_transformers_5_conversion():
    # mlx-community's Qwen3.5/3.6 configs name it `dtype`, in text_config.
    config = ModelConfig.from_dict(
        {"model_type": "qwen3_5_moe", "text_config": {"dtype": "bfloat16", "num_experts": 8}}
    )
    assert config.torch_dtype == "bfloat16"


def test_a_dense_model_has_no_moe_shape_and_odd_values_are_no_values():
    config = ModelConfig.from_dict(
        {"num_experts_per_tok": 2, "num_local_experts": 1, "max_position_embeddings": True}
    )
    assert (config.num_experts, config.experts_per_token) == (None, None) and not config.is_moe
    assert config.context_tokens is None  # a bool is no context length
    assert config.int_of("hidden_size", 7) == 7


def test_read_refuses_what_is_not_a_table(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a JSON object"):
        ModelConfig.read(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert ModelConfig.read(tmp_path).model_type == "mixtral"


def test_it_is_frozen():
    config = ModelConfig.from_dict({"text_config": {"hidden_size": 8}})
    with pytest.raises(AttributeError):
        config.hidden_size = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.text["hidden_size"] = 9  # type: ignore[index]
