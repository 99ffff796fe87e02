"""One prefix-cache file on the SSD: a list of layer caches as safetensors (mlx-lm's
save_prompt_cache) with moed's metadata, written atomically (a temporary file renamed into
place) and private (mode 0600: it holds a prompt's token ids), stamped with a fingerprint of the
model's files, moed's version and the cache layout, and bound to its name and contents by a
SHA-256 digest over the metadata (model, token ids, checkpoints, scope, the name) and every array
(safetensors has no checksum of its own). Rank 0's SSD tier (engine/prefix_cache/) and a pipeline
follower's store of its own layers (distributed/rank_disk.py) both write and read these; reading
goes through entry_file.py, which trusts nothing of a file before its sizes are checked."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from moed.daemon import __version__
from moed.daemon.model.cache_folder import make_private_folder
from moed.daemon.model.entry_file import EntryProblem, EntryRejected, open_entry
from moed.daemon.model.layer_caches import LayerCache

FORMAT_NAME = "moed-prefix-cache"
# 2: the digest covers the metadata and names the file; entries carry a scope. Files of another
# version are foreign (skipped, counted, evicted as the least recently used).
LAYOUT_VERSION = 2
FORMAT = f"{FORMAT_NAME}/{LAYOUT_VERSION}"
SUFFIX = ".safetensors"
_OURS = "0."  # save_prompt_cache flattens [metadata, classes, scalars]: ours are the "0." keys
_CLASSES = "1."


def model_fingerprint(model_path: Path, layer_classes: list[str], part: str = "") -> str:
    """The model's files (names, sizes, mtimes), moed's version and the cache layout, hashed;
    `part` names which layers a pipeline rank's files hold."""
    h = hashlib.sha256(f"{FORMAT_NAME} {LAYOUT_VERSION} moed {__version__}\n".encode())
    for f in sorted(Path(model_path).iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(",".join(layer_classes).encode())
    if part:
        h.update(f"\0{part}".encode())
    return h.hexdigest()[:32]


def digest(meta: Mapping[str, str], caches: list[LayerCache]) -> str:
    """SHA-256 over the metadata (but the digest itself), the caches' classes and every array
    with its name, dtype and shape: a flipped bit anywhere, or headers swapped between two
    entries, never reaches a request as a wrong token."""
    h = hashlib.sha256()
    for k in sorted(meta):
        if k != "digest":
            h.update(f"{len(k)}:{k}={len(meta[k])}:{meta[k]}\n".encode())
    h.update(("classes " + ",".join(type(c).__name__ for c in caches) + "\n").encode())
    pairs = cast(list[tuple[str, Any]], tree_flatten([c.state for c in caches]))  # no destination
    for name, a in pairs:
        if isinstance(a, mx.array):
            h.update(f"{name} {a.dtype} {tuple(a.shape)}\n".encode())
            view = memoryview(a)  # type: ignore[arg-type]  # mx.array exports the buffer protocol
            h.update(view.cast("B") if view.c_contiguous else view.tobytes())
        else:
            h.update(f"{name} {type(a).__name__} {a!r}\n".encode())
    return h.hexdigest()


def write_caches(
    path: Path, caches: list[LayerCache], fingerprint: str, meta: dict[str, str]
) -> int:
    """Write `caches` to `path` whole or not at all, mode 0600; returns the file's size (OSError,
    RuntimeError, ValueError: a full disk, a read-only folder, ...; no temporary file is left).
    The file's name (its key) is part of what the digest covers."""
    full = {"format": FORMAT, "fingerprint": fingerprint, "key": path.stem, **meta}
    full["digest"] = digest(full, caches)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp{SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            save_prompt_cache(f, caches, full)  # type: ignore[arg-type]  # mx.save_safetensors takes a file
            size = f.tell()
        os.replace(tmp, path)  # a reader sees the whole file or none
        return size
    except BaseException:
        unlink(tmp)
        raise


def read_metadata(path: Path, max_bytes: int) -> tuple[dict[str, str], int, float]:
    """An entry's own metadata, size and mtime, from its checked header alone (EntryRejected)."""
    with open_entry(path, max_bytes) as (_, header):
        return _ours(header.metadata), header.size, header.mtime


def check_stamp(meta: Mapping[str, str], fingerprint: str, path: Path) -> None:
    """EntryRejected unless the entry is of this format and model, named by its key."""
    if meta.get("format") != FORMAT or meta.get("fingerprint") != fingerprint:
        raise EntryRejected(EntryProblem.FOREIGN, "written for another model, moed or format")
    if meta.get("key") != path.stem:
        raise EntryRejected(EntryProblem.MISMATCH, "its name does not match its contents")


def read_caches(
    path: Path, fingerprint: str, max_bytes: int
) -> tuple[list[LayerCache], dict[str, str]]:
    """The caches of a file written by `write_caches` for `fingerprint`, and its metadata, once
    its digest matches; EntryRejected when it is foreign, malformed, corrupt or not a file."""
    with open_entry(path, max_bytes) as (f, header):
        meta = _ours(header.metadata)
        check_stamp(meta, fingerprint, path)
        classes = [v for k, v in header.metadata.items() if k.startswith(_CLASSES)]
        if not all(_is_cache_class(name) for name in classes):
            raise EntryRejected(EntryProblem.MALFORMED, "it names a class that is no cache")
        try:
            caches, _ = load_prompt_cache(f, return_metadata=True)
            mx.eval([c.state for c in caches])  # read now: the file closes on leaving
        except Exception:
            raise EntryRejected(EntryProblem.MALFORMED, "its arrays cannot be read") from None
    if meta.get("digest") != digest(meta, caches):
        raise EntryRejected(EntryProblem.MISMATCH, "its contents do not match its digest")
    return caches, meta


def _ours(metadata: Mapping[str, str]) -> dict[str, str]:
    return {k[len(_OURS) :]: v for k, v in metadata.items() if k.startswith(_OURS)}


def _is_cache_class(name: str) -> bool:
    """mlx-lm's loader looks a file's class names up in its cache module: only its cache
    classes may be named (each has `from_state`), never another of its names."""
    cls = getattr(mlx_cache, name, None) if name.isidentifier() else None
    return isinstance(cls, type) and callable(getattr(cls, "from_state", None))


def entry_files(directory: Path) -> list[Path]:
    """The entry files of a folder (made private if missing; UnsafeCacheFolder when others can
    write it), in name order, listed without following anything: what each is, opening tells.
    A write a crash cut short is removed. OSError when the folder cannot be made or read."""
    make_private_folder(directory)
    paths = []
    with os.scandir(directory) as it:
        names = sorted(e.name for e in it if e.name.endswith(SUFFIX))
    for name in names:
        path = directory / name
        if name.startswith("."):  # a temporary file of write_caches'
            unlink(path)
        else:
            paths.append(path)
    return paths


def unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
