"""Is a byte range of a file in the OS page cache right now? `mincore(2)` on a read-only mapping.

Mapping a file reads nothing and `mincore` faults nothing in, so asking does not change the answer.
Works on Linux and macOS; anywhere else (or on failure) the answer is None: unknown.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from pathlib import Path

PROT_READ = 0x1
MAP_SHARED = 0x1
PAGE = mmap.PAGESIZE  # 16 KiB on Apple Silicon, 4 KiB on most Linux

_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = lib
    return _libc


class PageCacheProbe:
    """Read-only mappings of checkpoint files, opened on first use and unmapped by close()."""

    def __init__(self) -> None:
        self._maps: dict[Path, tuple[int, int]] = {}  # path -> (address, length)
        self.available = sys.platform.startswith("linux") or sys.platform == "darwin"

    def _map(self, path: Path) -> tuple[int, int] | None:
        path = Path(path)
        if path in self._maps:
            return self._maps[path]
        libc = _load_libc()
        fd = os.open(path, os.O_RDONLY)
        try:
            length = os.fstat(fd).st_size
            if length == 0:
                return None
            addr = libc.mmap(None, length, PROT_READ, MAP_SHARED, fd, 0)
        finally:
            os.close(fd)  # the mapping keeps the file
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap {path} failed")
        self._maps[path] = (addr, length)
        return addr, length

    def resident_fraction(self, path: Path, offset: int, length: int) -> float | None:
        """Share of the pages holding [offset, offset + length) that are in the page cache."""
        if not self.available or length <= 0:
            return None
        try:
            mapped = self._map(path)
            if mapped is None:
                return None
            addr, size = mapped
            start = offset - offset % PAGE
            end = min(offset + length, size)
            npages = (end - start + PAGE - 1) // PAGE
            vec = ctypes.create_string_buffer(npages)
            if _load_libc().mincore(ctypes.c_void_p(addr + start), end - start, vec) != 0:
                return None
        except OSError:
            self.available = False  # do not retry a failing syscall on every miss
            return None
        return sum(b & 1 for b in vec.raw) / npages

    def close(self) -> None:
        if self._maps:
            libc = _load_libc()
            for addr, length in self._maps.values():
                libc.munmap(ctypes.c_void_p(addr), length)
        self._maps.clear()
