"""Where every tensor of a checkpoint lives on disk, from the safetensors headers.

A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, [begin, end) relative to the end of the header), then the data. We parse
the headers ourselves so that an expert's slice of a stacked `(E, ...)` tensor can be read with
`os.preadv` at `data_offset + e * expert_stride` without ever materializing the stack.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from moed.protocol.safetensors_dtypes import DTYPE_BYTES

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit; guards against a corrupt length


class CheckpointError(ValueError):
    """The checkpoint on disk cannot be indexed or does not match the model."""


@dataclass(frozen=True)
class TensorLoc:
    """One tensor's bytes in one file: data occupies [offset, offset + nbytes)."""

    name: str
    file: Path
    dtype: str  # safetensors dtype name, e.g. "U32", "BF16", "F32"
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @functools.cached_property  # asked once per expert read: compute it once per tensor
    def expert_stride(self) -> int:
        """Bytes of one leading-axis slice (one expert of a stacked tensor)."""
        return math.prod(self.shape[1:]) * self.itemsize

    def expert_range(self, expert: int) -> tuple[int, int]:
        stride = self.expert_stride
        return self.offset + expert * stride, stride


def read_header(path: Path) -> dict[str, TensorLoc]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {length} is implausible")
        header = json.loads(f.read(length))
    base = 8 + length
    out: dict[str, TensorLoc] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        begin, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        loc = TensorLoc(name, path, dtype, shape, base + begin, end - begin)
        if loc.nbytes != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{path}: tensor {name} size does not match its shape")
        out[name] = loc
    return out


def weight_files(model_path: Path) -> list[Path]:
    """The files mlx-lm loads: `model*.safetensors` (one file, or shards beside an index)."""
    files = sorted(Path(model_path).glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"no model*.safetensors in {model_path}")
    return files


class CheckpointIndex:
    """All tensors of a checkpoint (every shard), by name."""

    def __init__(self, model_path: Path):
        self.model_path = Path(model_path)
        self.files = weight_files(self.model_path)
        self.tensors: dict[str, TensorLoc] = {}
        for path in self.files:
            for name, loc in read_header(path).items():
                self.tensors[name] = loc

    def __getitem__(self, name: str) -> TensorLoc:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
