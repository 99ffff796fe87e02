"""Which decoder layers each rank runs: an even split, a given one, or one balanced by cost.

Splits are listed by rank, as `PipelineMixin.pipeline(group, split)` takes them: rank r runs the
layers after those of ranks r+1 ... size-1, so rank size-1 runs the first layers and rank 0 (the
daemon, which samples) the last ones.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from moed.daemon.experts.safetensors_index import CheckpointIndex

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class SplitMode(str, enum.Enum):
    EVEN = "even"  # mlx-lm's own split: the low ranks get the extra layers
    COST = "cost"  # contiguous runs with the most even per-token cost (from the checkpoint)


class SplitError(ValueError):
    pass


@dataclass(frozen=True)
class LayerCost:
    """Per-token cost of one layer: the weights it touches for one token, in bytes. Dense weights
    count in full; routed experts count top_k / num_experts of their bytes (a token reads k)."""

    dense_bytes: int
    expert_bytes: int
    top_k: int
    num_experts: int

    @property
    def per_token_bytes(self) -> float:
        if not self.num_experts:
            return float(self.dense_bytes)
        return self.dense_bytes + self.expert_bytes * self.top_k / self.num_experts


def parse_split(text: str, size: int, num_layers: int) -> tuple[int, ...] | SplitMode:
    """`even`, `cost`, or layers per rank as `a,b,...` (rank 0 first)."""
    text = (text or SplitMode.EVEN.value).strip().lower()
    if text in {m.value for m in SplitMode}:
        return SplitMode(text)
    try:
        split = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise SplitError(
            f"pipeline split {text!r}: use even, cost, or layers per rank like 20,20"
        ) from None
    check_split(split, size, num_layers)
    return split


def check_split(split: tuple[int, ...], size: int, num_layers: int) -> None:
    if len(split) != size:
        raise SplitError(f"split {list(split)} has {len(split)} entries for {size} ranks")
    if any(s < 1 for s in split) or sum(split) != num_layers:
        raise SplitError(f"split {list(split)} must be positive and sum to {num_layers} layers")


def even_split(size: int, num_layers: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, size)
    return tuple(base + (1 if r < extra else 0) for r in range(size))


def layer_costs(index: CheckpointIndex, num_layers: int, top_k: int) -> list[LayerCost]:
    """Per-layer bytes from the safetensors headers; stacked expert tensors are those whose
    leading dimension is the layer's expert count (the largest leading dim among 3-D tensors)."""
    dense = [0] * num_layers
    stacked: list[list] = [[] for _ in range(num_layers)]
    for name, loc in index.tensors.items():
        m = _LAYER.search(name)
        if m is None or int(m.group(1)) >= num_layers:
            continue
        layer = int(m.group(1))
        if len(loc.shape) == 3 and ("experts" in name or "switch_mlp" in name):
            stacked[layer].append(loc)
        else:
            dense[layer] += loc.nbytes
    costs = []
    for layer in range(num_layers):
        experts = stacked[layer]
        num = max((loc.shape[0] for loc in experts), default=0)
        costs.append(
            LayerCost(dense[layer], sum(loc.nbytes for loc in experts), top_k if num else 0, num)
        )
    return costs


def balanced_split(costs: list[float], size: int) -> tuple[int, ...]:
    """Contiguous runs of layers (first layers to the highest rank) minimising the largest run's
    cost: a pipeline runs at the speed of its slowest stage."""
    n = len(costs)
    if n < size:
        raise SplitError(f"{n} layers cannot be split over {size} ranks")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: the smallest possible largest stage over the first i layers in j stages
    best = [[inf] * (n + 1) for _ in range(size + 1)]
    cut = [[0] * (n + 1) for _ in range(size + 1)]
    best[0][0] = 0.0
    for j in range(1, size + 1):
        for i in range(j, n - (size - j) + 1):
            for k in range(j - 1, i):
                v = max(best[j - 1][k], prefix[i] - prefix[k])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, k
    stages, i = [], n
    for j in range(size, 0, -1):
        k = cut[j][i]
        stages.append(i - k)
        i = k
    # `stages` runs from the last layers back to the first: exactly rank 0 first.
    return tuple(stages)
