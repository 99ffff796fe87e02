"""The published checkpoints moed is built for, by their config.json alone (bench/published/).

- Qwen3.6-35B-A3B, 4-bit: the `mlx-community/Qwen3.6-35B-A3B-4bit` conversion's config.json. The
  text_config is Qwen's own (Qwen3.5/3.6-35B-A3B share it: 40 layers, every 4th full attention,
  256 experts top-8 of width 512 plus a shared expert of 512, hidden 2048, a 248,320-token
  vocabulary); the quantization block is what mlx-lm's `quant_predicate` for qwen3_5 writes and
  mlx-community's config carries: 4-bit affine, group 64, with an 8-bit override for every
  layer's router (`mlp.gate`) and shared-expert gate under the `language_model.model.layers.N`
  names the weights have on disk.
- Qwen3.5-122B-A10B, 4-bit: the same family at 48 layers, hidden 3072, 32 query heads, 64
  linear-attention value heads, experts and shared expert of width 1024 (no weights: the memory
  plan reads its shapes).

`shallower` keeps the first N layers of either, so `full_attention_interval`'s pattern (layers
3, 7, 11, ... are full attention) is the one the full model has.
"""

from __future__ import annotations

import copy
import enum
import json
from pathlib import Path
from typing import Any

PUBLISHED = Path(__file__).resolve().parent / "published"
CHAT_TEMPLATE = PUBLISHED / "qwen3.6.chat_template.jinja"  # Qwen3.6's own, thinking and XML tools


class PublishedModel(enum.Enum):
    QWEN36_35B_A3B = "qwen3.6-35b-a3b-4bit"
    QWEN35_122B_A10B = "qwen3.5-122b-a10b-4bit"

    @property
    def config_path(self) -> Path:
        return PUBLISHED / f"{self.value}.config.json"

    @property
    def repo(self) -> str:
        """The Hugging Face name of the conversion the config stands for."""
        return {
            PublishedModel.QWEN36_35B_A3B: "mlx-community/Qwen3.6-35B-A3B-4bit",
            PublishedModel.QWEN35_122B_A10B: "mlx-community/Qwen3.5-122B-A10B-4bit",
        }[self]

    def config(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.config_path.read_text())
        return loaded


class ReplicaConfigError(ValueError):
    """A replica's shape that the model cannot have."""


def shallower(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """`config` cut to its first `layers` layers: layer_types and the per-layer quantization
    overrides follow; at least one full-attention layer must remain (mlx-lm's qwen3_5 builds its
    attention mask from the first one)."""
    text = config["text_config"]
    total = int(text["num_hidden_layers"])
    every = int(text.get("full_attention_interval", 4))
    if not every <= layers <= total:
        raise ReplicaConfigError(
            f"--layers must be from {every} (one full-attention layer every {every}) to {total}, "
            f"got {layers}"
        )
    out = copy.deepcopy(config)
    out["text_config"]["num_hidden_layers"] = layers
    if "layer_types" in text:
        out["text_config"]["layer_types"] = list(text["layer_types"][:layers])
    for key in ("quantization", "quantization_config"):
        if key in out:
            out[key] = {k: v for k, v in out[key].items() if _layer_of(k) < layers}
    return out


def narrowed(config: dict[str, Any], **text: int) -> dict[str, Any]:
    """For tests only: the same model with smaller text_config widths (e.g. hidden_size=256,
    moe_intermediate_size=128) and a one-block vision tower of width 64, so a replica's write,
    load and decode fit a test's seconds. The command always writes the published shapes."""
    out = copy.deepcopy(config)
    out["text_config"].update(text)
    if "vision_config" in out:
        out["vision_config"].update(
            depth=1,
            hidden_size=64,
            intermediate_size=128,
            out_hidden_size=out["text_config"]["hidden_size"],
        )
    return out


def _layer_of(key: str) -> int:
    """The layer a per-module quantization key names (-1: not a layer's: kept)."""
    parts = key.split(".")
    if "layers" in parts:
        at = parts.index("layers") + 1
        if at < len(parts) and parts[at].isdigit():
            return int(parts[at])
    return -1
