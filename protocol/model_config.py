"""A checkpoint's config.json, read once into what every room asks of it.

A vision-language checkpoint (qwen3_5_moe) nests its language model's settings in `text_config`;
others keep them at the top. `text` resolves that once: the nested table over the top level, as
mlx-lm's text model reads it, so no room looks for the nesting itself. Here, not in daemon/, since
the client's `moe list` and `pull` read the same shape (experts, top-k) without the daemon.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

# Routed experts and experts per token, by the names the architectures give them.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k")


@dataclass(frozen=True)
class ModelConfig:
    raw: Mapping[str, Any]  # the file as written (what mlx-lm loads the model from)
    text: Mapping[str, Any]  # the language model's settings, text_config resolved
    model_type: str | None  # the architecture mlx-lm loads it as (top level)
    quantization: Mapping[str, Any] | None
    context_tokens: int | None  # max_position_embeddings
    vocab_size: int | None
    num_layers: int | None
    hidden_size: int | None
    num_experts: int | None  # routed experts; None for a dense model
    experts_per_token: int | None  # top-k; None for a dense model
    torch_dtype: str | None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        nested = config.get("text_config")
        text = {**config, **nested} if isinstance(nested, Mapping) else dict(config)
        experts = _first(text, EXPERT_COUNT_KEYS, minimum=2)
        quantization = config.get("quantization")
        model_type = config.get("model_type")
        # transformers 5 writes `dtype` (a qwen3_5_moe conversion: in text_config), 4 `torch_dtype`
        dtype = config.get("torch_dtype", text.get("torch_dtype", text.get("dtype")))
        return cls(
            raw=MappingProxyType(dict(config)),
            text=MappingProxyType(text),
            model_type=model_type if isinstance(model_type, str) else None,
            quantization=MappingProxyType(quantization) if isinstance(quantization, dict) else None,
            context_tokens=_first(text, ("max_position_embeddings",)),
            vocab_size=_first(text, ("vocab_size",)),
            num_layers=_first(text, ("num_hidden_layers",)),
            hidden_size=_first(text, ("hidden_size",)),
            num_experts=experts,
            experts_per_token=_first(text, TOP_K_KEYS) if experts else None,
            torch_dtype=dtype if isinstance(dtype, str) else None,
        )

    @classmethod
    def read(cls, folder: Path) -> ModelConfig:
        """The config.json in `folder` (OSError or ValueError when unreadable or not a table)."""
        config = json.loads((Path(folder) / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{folder}/config.json is not a JSON object")
        return cls.from_dict(config)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def int_of(self, key: str, default: int = 0) -> int:
        """A positive integer of the text config, else `default`."""
        return _first(self.text, (key,)) or default


def _first(table: Mapping[str, Any], keys: tuple[str, ...], minimum: int = 1) -> int | None:
    for key in keys:
        value = table.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return value
    return None
