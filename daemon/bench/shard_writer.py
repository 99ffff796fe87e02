"""Sharded safetensors written tensor by tensor, a chunk at a time: the header (JSON of every
tensor's dtype, shape and byte range, padded to 8 bytes as the format asks) goes first, computed
from the shapes alone, then each tensor's bytes as they are made. Memory stays at one chunk
whatever the model's size.

Shards are cut as mlx-lm's `make_shards` cuts them (a new shard once the next tensor would pass
the limit; 5 GiB by default) and named as `save_model` names them, with the same index file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moed.daemon.bench.replica_layout import TensorSpec

SHARD_BYTES = 5 << 30  # mlx-lm's MAX_FILE_SIZE_GB
CHUNK_BYTES = 32 << 20

# (tensor, first element, element count) -> those elements
Values = Callable[[TensorSpec, int, int], np.ndarray]


@dataclass(frozen=True)
class Shard:
    name: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(specs: Sequence[TensorSpec], limit: int = SHARD_BYTES) -> list[Shard]:
    groups: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not groups or size + spec.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    count = len(groups)
    names = (
        [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        if count > 1
        else ["model.safetensors"]
    )
    return [Shard(n, tuple(g)) for n, g in zip(names, groups)]


def header(tensors: Sequence[TensorSpec]) -> bytes:
    table: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for t in tensors:
        table[t.name] = {
            "dtype": t.dtype.value,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: Path, shard: Shard, make: Values, progress: Callable[[int], None]) -> None:
    """Write `shard` to `path`; `progress(n)` after every n bytes of tensor data."""
    with open(path, "wb") as f:
        f.write(header(shard.tensors))
        for spec in shard.tensors:
            total = spec.nbytes // spec.dtype.itemsize
            step = max(1, CHUNK_BYTES // spec.dtype.itemsize)
            for start in range(0, total, step):
                chunk = make(spec, start, min(step, total - start))
                f.write(chunk.data.cast("B"))  # the array's own buffer
                progress(chunk.nbytes)


def write_index(dest: Path, shards: Sequence[Shard], total_parameters: int) -> None:
    weight_map = {t.name: s.name for s in shards for t in s.tensors}
    index = {
        "metadata": {
            "total_size": sum(s.nbytes for s in shards),
            "total_parameters": total_parameters,
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
