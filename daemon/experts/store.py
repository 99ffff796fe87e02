"""The expert store: open checkpoint files, turn slot loads into coalesced `preadv` jobs, and apply
the page-cache policy.

Consecutive expert ids of one stacked tensor are adjacent on disk, so a run of missing experts
becomes one `preadv` with one iovec per destination slot (slots need not be adjacent in memory).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moed.daemon.config import PageCachePolicy
from moed.daemon.experts.cache import LayerPool

F_NOCACHE = 48  # macOS <sys/fcntl.h>: turn data caching off for this file descriptor
IOV_MAX = 1024  # POSIX minimum guaranteed is 16; Linux and macOS allow 1024
MAX_JOB_BYTES = 8 * 1024 * 1024  # split long runs so several workers share them
# A layer's misses are few (a handful of experts per token), so the slowest read sets the stall:
# cutting big slices into chunks lets every worker take a share of one expert. The size comes from
# `moed bench stream --sweep` (BENCHMARKS.md).
SPLIT_BYTES = 1024 * 1024


@dataclass
class ReadJob:
    fd: int
    offset: int
    buffers: list[memoryview] = field(default_factory=list)
    nbytes: int = 0


def resolve_page_cache(policy: PageCachePolicy, experts_bytes: int, machine_bytes: int) -> bool:
    """True when reads should bypass the page cache. AUTO bypasses once the experts exceed about
    half of memory: caching them would only evict pages the process needs."""
    policy = PageCachePolicy(policy)
    if policy is PageCachePolicy.BYPASS:
        return True
    if policy is PageCachePolicy.TRUST:
        return False
    return experts_bytes > machine_bytes // 2


def open_for_reads(path: Path, bypass: bool) -> int:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if bypass:
        if sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, F_NOCACHE, 1)
        elif hasattr(os, "posix_fadvise"):
            # Expert reads are random: readahead would only pull unwanted pages into the cache.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def drop_page_cache(files) -> bool:
    """Evict whole files' cached pages (Linux: fsync, then fadvise DONTNEED; dirty pages cannot be
    dropped). False where the OS offers no unprivileged way (macOS: `sudo purge`)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def drop_cached(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to drop clean cached pages of a range we just read (Linux; macOS uses
    F_NOCACHE)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class ExpertStore:
    def __init__(self, files: list[Path], bypass_page_cache: bool, split_bytes: int | None = None):
        self.bypass = bypass_page_cache
        self.split_bytes = SPLIT_BYTES if split_bytes is None else split_bytes
        # Linux drops what was read once per burst (the read pool does it when idle); macOS needs
        # nothing after the read: F_NOCACHE already kept the pages out.
        self.drop_after_read = bypass_page_cache and sys.platform != "darwin"
        self.fds: dict[Path, int] = {
            Path(f): open_for_reads(Path(f), bypass_page_cache) for f in files
        }

    def jobs_for(self, pool: LayerPool, loads: list[tuple[int, int]]) -> list[ReadJob]:
        """Read jobs that fill `loads` [(expert, slot)] of `pool`, adjacent experts coalesced."""
        jobs: list[ReadJob] = []
        by_expert = sorted(loads)
        for tensor in pool.tensors:
            loc = tensor.loc
            fd = self.fds[loc.file]
            stride = loc.expert_stride
            job: ReadJob | None = None
            prev = None
            for expert, slot in by_expert:
                offset = loc.offset + expert * stride
                extend = (
                    job is not None
                    and prev == expert - 1
                    and len(job.buffers) < IOV_MAX
                    and job.nbytes + stride <= max(MAX_JOB_BYTES, stride)
                )
                if not extend:
                    job = ReadJob(fd, offset)
                    jobs.append(job)
                job.buffers.append(pool.slot_view(tensor, slot))
                job.nbytes += stride
                prev = expert
        return [piece for job in jobs for piece in _split(job, self.split_bytes)]

    def run(self, job: ReadJob) -> int:
        """Do one job (on a worker thread). Returns bytes read."""
        done = 0
        buffers = job.buffers
        while buffers:
            n = os.preadv(job.fd, buffers, job.offset + done)
            if n <= 0:
                raise OSError(f"short read at offset {job.offset + done} (checkpoint truncated?)")
            done += n
            buffers = _advance(buffers, n)
        return done

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def _split(job: ReadJob, limit: int) -> list[ReadJob]:
    """Cut a job into jobs of at most `limit` bytes (contiguous file ranges, sliced iovecs)."""
    if limit <= 0 or job.nbytes <= limit:
        return [job]
    pieces: list[ReadJob] = []
    offset = job.offset
    current = ReadJob(job.fd, offset)
    for buf in job.buffers:
        start = 0
        while start < len(buf):
            take = min(len(buf) - start, limit - current.nbytes)
            current.buffers.append(buf[start : start + take])
            current.nbytes += take
            start += take
            if current.nbytes == limit:
                pieces.append(current)
                offset += current.nbytes
                current = ReadJob(job.fd, offset)
    if current.nbytes:
        pieces.append(current)
    return pieces


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first n bytes of an iovec list (after a short preadv)."""
    out = list(buffers)
    while out and n >= len(out[0]):
        n -= len(out[0])
        out.pop(0)
    if out and n:
        out[0] = out[0][n:]
    return out
