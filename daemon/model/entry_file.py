"""Opening a prefix-cache entry file without trusting it: a regular file of this user's only
(never a FIFO, a device, a directory or a symlink, so nothing blocks and nothing outside the
folder is read), and a safetensors header whose every size is checked against the file's real
size and a cap before any array is read.

Why an entry is refused is one of `EntryProblem` and a fixed sentence: nothing read from a file
(a length, a value, a name inside it) reaches the log.
"""

from __future__ import annotations

import enum
import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from moed.protocol.safetensors_dtypes import DTYPE_BYTES

MAX_HEADER = 64 << 20  # a header's JSON: token ids (base64) and the arrays' index


class EntryProblem(str, enum.Enum):
    """Why an entry file is skipped (counted per reason: stats' disk_rejected)."""

    NOT_REGULAR = "not_regular"  # a FIFO, device, directory or symlink: never opened for reading
    NOT_OURS = "not_ours"  # owned by another user
    TOO_LARGE = "too_large"  # larger than the tier's budget
    MALFORMED = "malformed"  # a header that does not parse, or sizes that do not add up
    FOREIGN = "foreign"  # another model, moed version or file format (an older moed's too)
    MISMATCH = "mismatch"  # the digest or the file's name disagrees with its contents
    UNREADABLE = "unreadable"  # an I/O error


class EntryRejected(Exception):
    def __init__(self, problem: EntryProblem, why: str):
        super().__init__(why)
        self.problem = problem
        self.why = why  # a fixed sentence: never anything read from the file


@dataclass(frozen=True)
class EntryHeader:
    size: int  # the file's size in bytes
    mtime: float
    metadata: dict[str, str]  # safetensors' __metadata__ (mlx-lm's flattened keys)


@contextmanager
def open_entry(path: Path, max_bytes: int) -> Iterator[tuple[IO[bytes], EntryHeader]]:
    """The open file (at its start) and its checked header; EntryRejected otherwise."""
    f = _open_regular(path)
    try:
        st = os.fstat(f.fileno())
        if st.st_size > max_bytes:
            raise EntryRejected(EntryProblem.TOO_LARGE, "it is larger than the tier's budget")
        header = EntryHeader(st.st_size, st.st_mtime, _read_header(f, st.st_size))
        f.seek(0)
        yield f, header
    finally:
        f.close()


def _open_regular(path: Path) -> IO[bytes]:
    """Open without following a symlink and without blocking (a FIFO opens at once, then is
    refused by fstat); lstat first, so a device is never opened at all."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise EntryRejected(EntryProblem.NOT_REGULAR, "it is not a regular file")
        # open() keeps the path as the file's name: mlx's loader tells the format by it.
        f = open(path, "rb", opener=_no_follow)  # noqa: SIM115  # closed by the caller
    except EntryRejected:
        raise
    except OSError as exc:  # ELOOP: it became a symlink since the lstat
        why = f"it cannot be opened ({exc.strerror})"
        raise EntryRejected(EntryProblem.UNREADABLE, why) from None
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # replaced between the lstat and the open
            raise EntryRejected(EntryProblem.NOT_REGULAR, "it is not a regular file")
        if st.st_uid != os.geteuid():
            raise EntryRejected(EntryProblem.NOT_OURS, "it is owned by another user")
    except BaseException:
        f.close()
        raise
    return f


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))


def _read_header(f: IO[bytes], size: int) -> dict[str, str]:
    """The header's metadata, once the header's length, every tensor's dtype, shape and byte
    range are known to fit the file as it is."""
    malformed = EntryProblem.MALFORMED
    head = f.read(8)
    if len(head) != 8:
        raise EntryRejected(malformed, "it is shorter than a header")
    (n,) = struct.unpack("<Q", head)
    if not 0 < n <= min(MAX_HEADER, size - 8):
        raise EntryRejected(malformed, "its header's length does not fit the file")
    raw = f.read(n)
    if len(raw) != n:
        raise EntryRejected(malformed, "its header is cut short")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise EntryRejected(malformed, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise EntryRejected(malformed, "its header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise EntryRejected(malformed, "its header has no metadata of strings")
    data = size - 8 - n
    for info in header.values():
        _check_tensor(info, data)
    return meta


def _check_tensor(info: Any, data_bytes: int) -> None:
    """One tensor of the header: a known dtype, a shape of sizes, and a byte range inside the
    file's data whose length is what the dtype and shape claim."""
    malformed = EntryProblem.MALFORMED
    if not isinstance(info, dict):
        raise EntryRejected(malformed, "a tensor of its header is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise EntryRejected(malformed, "a tensor of its header has an unknown dtype")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise EntryRejected(malformed, "a tensor of its header has a malformed shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
        raise EntryRejected(malformed, "a tensor of its header has malformed offsets")
    begin, end = offsets
    claimed = math.prod(shape) * DTYPE_BYTES[dtype]
    if not begin <= end <= data_bytes:
        raise EntryRejected(malformed, "a tensor of its header lies beyond the file's end")
    if end - begin != claimed:
        raise EntryRejected(malformed, "a tensor of its header does not match its byte range")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
