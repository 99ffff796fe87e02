"""One prefix-cache file on the SSD: a list of layer caches as safetensors (mlx-lm's
save_prompt_cache) with moed's metadata, written atomically (a temporary file renamed into
place), stamped with a fingerprint of the model's files, moed's version and the cache layout, and
checksummed (safetensors has none of its own). Rank 0's SSD tier (disk_tier.py) and a pipeline
follower's store of its own layers (distributed/rank_disk.py) both write and read these."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from moed.daemon import __version__
from moed.daemon.model.layer_caches import LayerCache

FORMAT = "moed-prefix-cache"
LAYOUT_VERSION = 1  # what the files hold and how: bump on any change
SUFFIX = ".safetensors"
_MAX_HEADER = 64 << 20


def model_fingerprint(model_path: Path, layer_classes: list[str], part: str = "") -> str:
    """The model's files (names, sizes, mtimes), moed's version and the cache layout, hashed;
    `part` names which layers a pipeline rank's files hold."""
    h = hashlib.sha256(f"{FORMAT} {LAYOUT_VERSION} moed {__version__}\n".encode())
    for f in sorted(Path(model_path).iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(",".join(layer_classes).encode())
    if part:
        h.update(f"\0{part}".encode())
    return h.hexdigest()[:32]


def checksum(caches: list[LayerCache]) -> str:
    """CRC-32 of every array the caches hold, in order: safetensors has no checksum of its own,
    and a flipped bit must never reach a request as a wrong token."""
    crc = 0
    pairs = cast(list[tuple[str, Any]], tree_flatten([c.state for c in caches]))  # no destination
    for _, a in pairs:
        if isinstance(a, mx.array):
            view = memoryview(a)  # type: ignore[arg-type]  # mx.array exports the buffer protocol
            crc = zlib.crc32(view.cast("B") if view.c_contiguous else view.tobytes(), crc)
    return f"{crc:08x}"


def read_metadata(path: Path) -> dict[str, Any]:
    """A safetensors file's own metadata, from its header alone (ValueError when unreadable)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("truncated header")
        (n,) = struct.unpack("<Q", head)
        if not 0 < n <= _MAX_HEADER:
            raise ValueError(f"header length {n}")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError("truncated header")
    header = json.loads(raw)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    # save_prompt_cache flattens [metadata, classes, scalars]: ours are the "0." keys.
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def write_caches(
    path: Path, caches: list[LayerCache], fingerprint: str, meta: dict[str, Any]
) -> int:
    """Write `caches` to `path` whole or not at all; returns the file's size (OSError,
    RuntimeError, ValueError: a full disk, a read-only folder, ...; no temporary file is left)."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{SUFFIX}")
    full = {"format": FORMAT, "fingerprint": fingerprint, "crc32": checksum(caches), **meta}
    try:
        save_prompt_cache(str(tmp), caches, full)
        os.replace(tmp, path)  # a reader sees the whole file or none
        return path.stat().st_size
    except BaseException:
        unlink(tmp)
        raise


def read_caches(path: Path, fingerprint: str) -> tuple[list[LayerCache], dict[str, Any]]:
    """The caches of a file written by `write_caches` for `fingerprint`, and its metadata;
    ValueError (or whatever the reader raises) when it is foreign, corrupt or truncated."""
    caches, meta = load_prompt_cache(str(path), return_metadata=True)
    if meta.get("fingerprint") != fingerprint or meta.get("format") != FORMAT:
        raise ValueError("written for another model, moed version or layout")
    if meta.get("crc32") != checksum(caches):
        raise ValueError("its data does not match its checksum")
    return caches, meta


def entry_files(directory: Path) -> list[Path]:
    """The entry files of a folder (made, private, if missing), in name order; a write a crash
    cut short is removed. OSError when the folder cannot be made or read."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = []
    for path in sorted(directory.glob("*" + SUFFIX)):
        if path.name.startswith("."):  # a temporary file of write_caches'
            unlink(path)
        else:
            paths.append(path)
    return paths


def unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
