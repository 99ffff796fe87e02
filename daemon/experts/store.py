"""The expert store: open checkpoint files, turn slot loads into coalesced `preadv` jobs, and apply
the page-cache policy.

Consecutive expert ids of one stacked tensor are adjacent on disk, so a run of missing experts
becomes one `preadv` with one iovec per destination slot (slots need not be adjacent in memory).

Bypassing the page cache: macOS sets F_NOCACHE on the file. Linux reads with O_DIRECT into an
aligned per-thread bounce buffer and copies the wanted bytes into the slots (expert slices start at
unaligned offsets); a small read that skips the page cache returns about twice as fast there
(BENCHMARKS.md). Where the file system refuses O_DIRECT, reads go through the page cache and the
read pool drops what a burst read.
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from moed.daemon.experts.landing import Staging

if TYPE_CHECKING:  # types only: cache.py imports mlx, and the configuration imports this module
    from moed.daemon.experts.cache import PooledTensor

F_NOCACHE = 48  # macOS <sys/fcntl.h>: turn data caching off for this file descriptor
IOV_MAX = 1024  # POSIX minimum guaranteed is 16; Linux and macOS allow 1024
MAX_JOB_BYTES = 8 * 1024 * 1024  # split long runs so several workers share them
# A layer's misses are few (a handful of experts per token), so the slowest read sets the stall:
# cutting big slices into chunks lets every worker take a share of one expert. The size comes from
# `moed bench stream --sweep` (BENCHMARKS.md).
SPLIT_BYTES = 1024 * 1024
# O_DIRECT wants file offset, length and buffer aligned to the device's logical block (512 B or
# 4 KiB); a page covers both. A device that wants more refuses the read and we fall back.
DIRECT_ALIGN = 4096

log = logging.getLogger("moed.experts")


class PageCachePolicy(str, enum.Enum):
    AUTO = "auto"  # bypass when the experts are much larger than RAM, trust otherwise
    BYPASS = "bypass"  # F_NOCACHE on macOS, POSIX_FADV_DONTNEED / O_DIRECT on Linux
    TRUST = "trust"


class ReadTarget(Protocol):
    """What reads fill: a layer's pool (cache.py LayerPool) or the pass lane (pass_lane.py)."""

    tensors: list[PooledTensor]  # where each expert's bytes are in the checkpoint

    def destinations(self, staging: Staging, tensor: PooledTensor) -> list[memoryview]:
        """Where each load of `staging` reads `tensor` into, in the loads' order."""
        ...


@dataclass(slots=True)  # a few per layer call's misses: no instance dict to build
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


def drop_page_cache(files: Iterable[str | os.PathLike[str]]) -> bool:
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


def aligned_span(offset: int, nbytes: int, align: int | None = None) -> tuple[int, int]:
    """(start, length) of the smallest `align`-aligned file range that holds [offset, offset +
    nbytes): what an O_DIRECT read of that range must ask for."""
    align = DIRECT_ALIGN if align is None else align
    start = offset - offset % align
    return start, -(-(offset + nbytes) // align) * align - start


def open_direct(path: Path) -> int | None:
    """An O_DIRECT descriptor for reads that skip the page cache (Linux), or None where the OS or
    the file system has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or sys.platform == "darwin":
        return None
    try:
        return os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def drop_cached(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to drop clean cached pages of a range we just read (Linux; macOS uses
    F_NOCACHE)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class ExpertStore:
    def __init__(self, files: list[Path], bypass_page_cache: bool, split_bytes: int | None = None):
        self.bypass = bypass_page_cache
        self.split_bytes = SPLIT_BYTES if split_bytes is None else split_bytes
        self.fds: dict[Path, int] = {
            Path(f): open_for_reads(Path(f), bypass_page_cache) for f in files
        }
        # Buffered fd -> its O_DIRECT twin (Linux, page cache bypassed).
        self.direct: dict[int, int] = {}
        if bypass_page_cache:
            for path, fd in self.fds.items():
                if (dfd := open_direct(path)) is not None:
                    self.direct[fd] = dfd
        # A refused file leaves `direct`; close() still closes its descriptor.
        self._direct_fds = list(self.direct.values())
        if self.drop_after_read:
            log.info(
                "no O_DIRECT for %d of %d checkpoint files: their pages are dropped after each "
                "burst of reads",
                len(self.fds) - len(self.direct),
                len(self.fds),
            )
        self._bounce = threading.local()
        self._reads_of: dict[
            int, tuple[list[PooledTensor], list[tuple[PooledTensor, int, int, int]]]
        ] = {}

    @property
    def drop_after_read(self) -> bool:
        """Linux without O_DIRECT drops what was read once per burst (the read pool does it when
        idle); O_DIRECT and macOS's F_NOCACHE keep the pages out in the first place."""
        return self.bypass and sys.platform != "darwin" and len(self.direct) < len(self.fds)

    def _tensor_reads(
        self, tensors: list[PooledTensor]
    ) -> list[tuple[PooledTensor, int, int, int]]:
        """(tensor, fd, offset, stride) of a pool's tensors, worked out once per pool (a Path's
        hash and the attribute lookups cost more than the rest of a layer call's read jobs)."""
        cached = self._reads_of.get(id(tensors))
        if cached is None or cached[0] is not tensors:  # the list itself is held: ids stay unique
            cached = (
                tensors,
                [(t, self.fds[t.loc.file], t.loc.offset, t.loc.expert_stride) for t in tensors],
            )
            self._reads_of[id(tensors)] = cached
        return cached[1]

    def jobs_for(self, pool: ReadTarget, staging: Staging) -> list[ReadJob]:
        """Read jobs that fill `staging`'s loads [(expert, slot)] of `pool` (in expert order),
        adjacent experts coalesced."""
        jobs: list[ReadJob] = []
        loads, split = staging.loads, self.split_bytes
        if len(loads) == 1:  # a decode call's usual miss: one job per tensor, nothing to join
            expert = loads[0][0]
            for tensor, fd, base, stride in self._tensor_reads(pool.tensors):
                jobs.append(
                    ReadJob(fd, base + expert * stride, pool.destinations(staging, tensor), stride)
                )
            return (
                jobs
                if split <= 0 or all(j.nbytes <= split for j in jobs)
                else _split_all(jobs, split)
            )
        for tensor, fd, base, stride in self._tensor_reads(pool.tensors):
            limit = max(MAX_JOB_BYTES, stride)
            job: ReadJob | None = None
            prev = -2
            for (expert, _slot), dest in zip(loads, pool.destinations(staging, tensor)):
                if (
                    job is not None
                    and prev == expert - 1
                    and len(job.buffers) < IOV_MAX
                    and job.nbytes + stride <= limit
                ):
                    job.buffers.append(dest)
                    job.nbytes += stride
                else:
                    job = ReadJob(fd, base + expert * stride, [dest], stride)
                    jobs.append(job)
                prev = expert
        return jobs if split <= 0 else _split_all(jobs, split)

    def run(self, job: ReadJob) -> int:
        """Do one job (on a worker thread). Returns bytes read."""
        dfd = self.direct.get(job.fd)
        if dfd is not None:
            try:
                return self._run_direct(dfd, job)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # The device wants a larger alignment (or the file system changed its mind).
                log.warning(
                    "O_DIRECT read refused (%s); this file is read through the page cache", exc
                )
                self.direct.pop(job.fd, None)
        done = 0
        buffers = job.buffers
        while buffers:
            n = os.preadv(job.fd, buffers, job.offset + done)
            if n <= 0:
                raise OSError(f"short read at offset {job.offset + done} (checkpoint truncated?)")
            done += n
            buffers = _advance(buffers, n)
        return done

    def _run_direct(self, dfd: int, job: ReadJob) -> int:
        """Read the aligned file range around the job into this thread's bounce buffer, then copy
        each slot's bytes out of it."""
        start, span = aligned_span(job.offset, job.nbytes)
        bounce = self._bounce_view(span)
        got, want = 0, job.offset + job.nbytes - start
        while got < want:  # the aligned span may run past the end of the file: short there
            n = os.preadv(dfd, [bounce[got:span]], start + got)
            if n <= 0:
                raise OSError(f"short read at offset {start + got} (checkpoint truncated?)")
            got += n
        pos = job.offset - start
        for buf in job.buffers:
            buf[:] = bounce[pos : pos + len(buf)]
            pos += len(buf)
        return job.nbytes

    def _bounce_view(self, nbytes: int) -> memoryview:
        """This thread's page-aligned buffer of at least nbytes (mmap memory is page aligned).
        One chunk plus two pages per read worker: about 8 MB in all, within the memory plan's
        working memory (at least 32 MB)."""
        local = self._bounce
        if getattr(local, "size", 0) < nbytes:
            size = max(nbytes, self.split_bytes + 2 * DIRECT_ALIGN)
            local.map = mmap.mmap(-1, size)
            local.view = memoryview(local.map)
            local.size = size
        view: memoryview = local.view  # a threading.local: attributes untyped
        return view

    def close(self) -> None:
        for fd in [*self.fds.values(), *self._direct_fds]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
        self.direct.clear()
        self._direct_fds.clear()


def _split_all(jobs: list[ReadJob], limit: int) -> list[ReadJob]:
    return [
        piece for job in jobs for piece in (_split(job, limit) if job.nbytes > limit else (job,))
    ]


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
