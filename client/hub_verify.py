"""Checks on what a pull brought: safetensors headers against their files, the shard index, and
JSON side files read within a size bound (a 1 GiB config.json is refused, never loaded)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from moed.protocol.safetensors_dtypes import DTYPE_BYTES

from .hub_names import UnsafeName, check_file_name


class PullError(Exception):
    """The model cannot be pulled (not found, not an mlx-lm checkpoint, or damaged on arrival)."""


# A real config.json or shard index is kilobytes to a few megabytes (per-layer quantization maps
# included); anything larger is not a config but an attack on `moe list`'s memory.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
# safetensors' own limit; headers of real shards (thousands of tensors) stay far below it.
MAX_HEADER_BYTES = 100_000_000


def read_json_file(path: Path, limit: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """A JSON object from a file no larger than `limit`; PullError naming the file otherwise."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise PullError(f"{path.name} is {size} bytes, over the {limit}-byte limit")
            data = f.read(limit + 1)
    except OSError as exc:
        raise PullError(f"{path.name} cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise PullError(f"{path.name} is over the {limit}-byte limit")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PullError(f"{path.name} is not JSON ({str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise PullError(f"{path.name} is not a JSON object")
    return value


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(value)
    return value


def verify_safetensors(path: Path) -> int:
    """Check a shard's header against its size: every tensor inside the file, the data region
    exactly covered. Returns the tensor count; raises PullError naming the damage."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PullError(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise PullError(f"{path.name}: header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:
            raise PullError(f"{path.name}: the header is not JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise PullError(f"{path.name}: the header is not a JSON object")
    data_bytes = size - 8 - n
    end_max = 0
    tensors = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (_int(v) for v in entry["data_offsets"])
            count = 1
            for dim in entry["shape"]:
                count *= _int(dim)
            width = DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise PullError(f"{path.name}: tensor {name[:200]!r} has a malformed entry") from None
        if not 0 <= begin <= end <= data_bytes or end - begin != count * width:
            raise PullError(
                f"{path.name}: tensor {name[:200]!r} at bytes {begin}-{end} does not fit its "
                f"shape or the file ({data_bytes} data bytes): truncated or damaged"
            )
        end_max = max(end_max, end)
        tensors += 1
    if end_max != data_bytes:
        raise PullError(
            f"{path.name}: tensors cover {end_max} of {data_bytes} data bytes: truncated or damaged"
        )
    return tensors


def verify_checkpoint(folder: Path) -> int:
    """Every shard's header is sound and the index names only shards that are there."""
    shards = sorted(folder.glob("model*.safetensors"))
    if not shards:
        raise PullError(f"{folder}: no model*.safetensors")
    for shard in shards:
        verify_safetensors(shard)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_file(index).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise PullError(f"{index.name}: `weight_map` is not a JSON object")
        try:
            named = {check_file_name(f) for f in weight_map.values()}
        except UnsafeName as exc:
            raise PullError(f"{index.name}: {exc}") from None
        missing = sorted(f for f in named if not (folder / f).exists())
        if missing:
            raise PullError(f"{folder.name}: the index names missing shards {missing[:10]}")
    return len(shards)
