"""Every tensor a published conversion stores: name, shape, dtype and what its values must be.

The language model's tensors come from mlx-lm itself: the model a config.json describes, built
with its parameters lazy (nothing evaluated, no memory) and quantized as `mlx_lm.load` quantizes
it (the config's per-module overrides first, every other quantizable layer at the default), so
the names and shapes are the ones `mlx_lm.load` will ask for. Dtypes are the conversion's:
packed weights uint32, everything floating bfloat16 except `A_log`, which mlx-lm's
`cast_predicate` keeps at float32. The vision tower (`vision_tower.*`, unquantized bfloat16, 333
tensors at depth 27) is what an mlx-community Qwen3.5/3.6 conversion carries beside the text
model; mlx-lm's sanitize drops it at load, so it only costs disk, as in the real checkpoint.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

DEFAULT_GROUP = 64
DEFAULT_BITS = 4


class Dtype(enum.Enum):
    U32 = "U32"
    BF16 = "BF16"
    F32 = "F32"

    @property
    def itemsize(self) -> int:
        return 2 if self is Dtype.BF16 else 4


class Fill(enum.Enum):
    """How a tensor's values are made (bench/replica_values.py)."""

    PACKED = "packed"  # random quantized codes
    SCALES = "scales"  # per-group scales: dequantized weights of std ~1/sqrt(fan_in)
    BIASES = "biases"  # -mid * scale: zero-mean dequantized weights
    ONES = "ones"  # RMSNorm weights, dt_bias
    A_LOG = "a_log"  # log(uniform(1, 16)): decays of the gated delta net, as mlx-lm initializes
    SMALL = "small"  # small values of either sign (conv taps, the unused vision tower)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: Dtype
    fill: Fill
    bits: int = 0  # of a quantized layer's weight, scales and biases
    fan_in: int = 0  # input features of a quantized layer (sets its scales)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def module(self) -> str:
        """The module the tensor belongs to: scales and biases of one module share their
        random jitter (replica_values.py), so each bias is -mid times its own scale."""
        return self.name.rsplit(".", 1)[0]


# Stacked expert tensors (bench stream's plan reads the same names: experts/memory_plan.py).
EXPERT_TENSOR = re.compile(r"\.(?:switch_mlp|experts)\.")


def text_tensors(config: Mapping[str, Any]) -> list[TensorSpec]:
    """The language model's tensors as mlx-lm loads them from a conversion with `config`."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from moed.daemon.model.mlx_compat import unloaded_model  # mlx-lm too

    model = unloaded_model(config)
    quant = dict(config.get("quantization") or {})
    group = int(quant.get("group_size", DEFAULT_GROUP))
    bits = int(quant.get("bits", DEFAULT_BITS))

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if path in quant:
            override: dict = quant[path]
            return override
        return hasattr(module, "to_quantized") and module.weight.shape[-1] % group == 0

    if quant:
        nn.quantize(model, group_size=group, bits=bits, class_predicate=predicate)
    quantized = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))
    }
    specs = []
    # tree_flatten is typed as a list or a dict; without a `destination` it is the list.
    for name, value in cast("list[tuple[str, Any]]", tree_flatten(model.parameters())):
        module, _, param = name.rpartition(".")
        shape = tuple(int(s) for s in value.shape)
        q = quantized.get(module)
        if q is not None and param in ("weight", "scales", "biases"):
            fan_in = shape[-1] * 32 // q.bits if param == "weight" else shape[-1] * q.group_size
            fill = {"weight": Fill.PACKED, "scales": Fill.SCALES, "biases": Fill.BIASES}[param]
            dtype = Dtype.U32 if param == "weight" else Dtype.BF16
            specs.append(TensorSpec(name, shape, dtype, fill, q.bits, fan_in))
        elif param == "A_log":
            specs.append(TensorSpec(name, shape, Dtype.F32, Fill.A_LOG))
        elif param == "dt_bias" or name.endswith("norm.weight"):
            specs.append(TensorSpec(name, shape, Dtype.BF16, Fill.ONES))
        else:
            specs.append(TensorSpec(name, shape, Dtype.BF16, Fill.SMALL))
    return specs


def vision_tensors(vision: Mapping[str, Any]) -> list[TensorSpec]:
    """The Qwen3-VL vision tower of a Qwen3.5/3.6 conversion, unquantized, as mlx-vlm stores it:
    a Conv3d patch embedding (channels last), learned positions, `depth` pre-norm blocks, and the
    merger of 2x2 patches into the language model's width."""
    hidden, inner = int(vision["hidden_size"]), int(vision["intermediate_size"])
    patch, temporal = int(vision["patch_size"]), int(vision["temporal_patch_size"])
    merged = hidden * int(vision["spatial_merge_size"]) ** 2
    out = int(vision["out_hidden_size"])
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("patch_embed.proj.weight", (hidden, temporal, patch, patch, int(vision["in_channels"]))),
        ("patch_embed.proj.bias", (hidden,)),
        ("pos_embed.weight", (int(vision["num_position_embeddings"]), hidden)),
    ]
    for i in range(int(vision["depth"])):
        block = f"blocks.{i}"
        shapes += [
            (f"{block}.attn.qkv.weight", (3 * hidden, hidden)),
            (f"{block}.attn.qkv.bias", (3 * hidden,)),
            (f"{block}.attn.proj.weight", (hidden, hidden)),
            (f"{block}.attn.proj.bias", (hidden,)),
            (f"{block}.mlp.linear_fc1.weight", (inner, hidden)),
            (f"{block}.mlp.linear_fc1.bias", (inner,)),
            (f"{block}.mlp.linear_fc2.weight", (hidden, inner)),
            (f"{block}.mlp.linear_fc2.bias", (hidden,)),
            (f"{block}.norm1.weight", (hidden,)),
            (f"{block}.norm1.bias", (hidden,)),
            (f"{block}.norm2.weight", (hidden,)),
            (f"{block}.norm2.bias", (hidden,)),
        ]
    shapes += [
        ("merger.norm.weight", (hidden,)),
        ("merger.norm.bias", (hidden,)),
        ("merger.linear_fc1.weight", (merged, merged)),
        ("merger.linear_fc1.bias", (merged,)),
        ("merger.linear_fc2.weight", (out, merged)),
        ("merger.linear_fc2.bias", (out,)),
    ]
    return [
        TensorSpec(f"vision_tower.{name}", shape, Dtype.BF16, Fill.SMALL) for name, shape in shapes
    ]


def replica_tensors(config: Mapping[str, Any], floats: Dtype = Dtype.BF16) -> list[TensorSpec]:
    """Every tensor of the conversion, in the order the shards hold them: the language model by
    layer (experts of a layer together), then the vision tower. `floats` F32: the bfloat16
    tensors in float32 (MLX's CPU backend runs bfloat16 several times slower)."""
    specs = text_tensors(config)
    if isinstance(config.get("vision_config"), Mapping):
        specs += vision_tensors(config["vision_config"])
    if floats is not Dtype.BF16:
        specs = [replace(s, dtype=floats) if s.dtype is Dtype.BF16 else s for s in specs]
    return sorted(specs, key=lambda s: _natural(s.name))


def _natural(name: str) -> list[tuple[int, int | str]]:
    # Typed pairs so digits and words never compare with each other.
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name)]
