"""Read workers: threads that run read jobs in parallel, demand reads before speculative ones.

Workers only call `os.preadv` into slot memory (the GIL is released during the read); every MLX
call stays on the engine thread. A speculative job still queued can be cancelled when the layer
it was meant for turns out not to need it; one already running is waited for (it writes a slot).
When the page cache is bypassed on Linux and the file system refuses O_DIRECT, the pages just read
are dropped once per burst (when the queues run empty), by a worker, instead of one
`posix_fadvise` per read on the critical path.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field

from moed.daemon.experts.store import ExpertStore, ReadJob, drop_cached

# Measured with `moed bench stream --sweep` (BENCHMARKS.md): with 1 MiB chunks, 8 workers read a
# layer's misses at 0.8 of raw parallel pread where 4 workers stayed near 0.6.
DEFAULT_WORKERS = 8
# Idle-only jobs (lookahead.py) running at once: a demand burst that arrives meanwhile waits for
# at most this many 1 MiB chunks ahead of it on the disk.
IDLE_DEPTH = 2


def default_workers(bypass_page_cache: bool = True) -> int:
    """Reads that go to the SSD want queue depth; reads the page cache answers are memory copies,
    CPU-bound, so more workers than cores only contend (on 2 cores, 8 workers made a 4-row batch's
    reads at 25% take 2-3x longer than 2 workers: `moed bench batch`, BENCHMARKS.md)."""
    if bypass_page_cache:
        return DEFAULT_WORKERS
    return max(1, min(DEFAULT_WORKERS, os.cpu_count() or 1))


@dataclass
class ReadResult:
    bytes_read: int = 0
    read_s: float = 0.0  # summed over jobs (worker time)
    wall_s: float = 0.0  # engine thread blocked
    jobs: int = 0  # jobs run (cancelled ones not counted)


@dataclass(eq=False)
class ReadBatch:
    """The jobs of one `submit`, completed together: the engine waits on the pool's condition
    until `left` is 0, not on a Future (and its lock) per job nor an Event per burst (its lock
    and condition, built on the engine thread's path). Fields change under the pool's lock."""

    jobs: list[ReadJob]
    speculative: bool = False
    # Started only while no demand job is queued or running (the disk would otherwise idle).
    idle_only: bool = False
    left: int = 0  # jobs not finished yet (run or cancelled)
    started: int = 0  # jobs a worker took (they write their slots: wait for them)
    cancelled: bool = False
    cancelled_bytes: int = 0  # queued jobs dropped by cancel() before they started
    result: ReadResult = field(default_factory=ReadResult)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.left = len(self.jobs)

    @property
    def nbytes(self) -> int:
        return sum(j.nbytes for j in self.jobs)


class ReadPool:
    def __init__(self, store: ExpertStore, workers: int = 0):
        self.store = store
        self.workers = workers if workers > 0 else default_workers(store.bypass)
        lock = threading.RLock()  # re-entrant, as a Condition's own (tests hold it around submit)
        self._cv = threading.Condition(lock)  # workers wait here for jobs
        self._finished = threading.Condition(lock)  # the engine waits here for batches
        self._demand: collections.deque[tuple[ReadBatch, ReadJob]] = collections.deque()
        self._speculative: collections.deque[tuple[ReadBatch, ReadJob]] = collections.deque()
        self._to_drop: dict[
            int, tuple[int, int]
        ] = {}  # fd -> (start, end) read since the last drop
        self._busy = 0
        self._demand_busy = 0  # demand jobs running: idle-only jobs wait for none
        self._idle_busy = 0  # idle-only jobs running (at most IDLE_DEPTH)
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"moed-read-{i}", daemon=True)
            for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    # -- workers ---------------------------------------------------------------------------

    def _next(self) -> tuple[ReadBatch, ReadJob] | None:
        with self._cv:
            while True:
                queue = self._demand or self._speculative
                # An idle-only job waits while a demand read is queued or running.
                if queue and (not queue[0][0].idle_only or self._idle()):
                    batch, job = queue.popleft()
                    batch.started += 1
                    self._busy += 1
                    if not batch.speculative:
                        self._demand_busy += 1
                    elif batch.idle_only:
                        self._idle_busy += 1
                    if self._demand or self._speculative:
                        self._cv.notify()  # wake the next worker: the engine thread woke only one
                    return batch, job
                if self._closed:
                    return None
                if self._to_drop and not self._busy:
                    drops, self._to_drop = self._to_drop, {}
                    self._cv.release()
                    try:  # the burst is over: drop its pages, off the engine's critical path
                        for fd, (start, end) in drops.items():
                            drop_cached(fd, start, end - start)
                    except OSError:
                        pass  # advisory: a closed fd at shutdown loses nothing
                    finally:
                        self._cv.acquire()
                    continue
                self._cv.wait()

    def _idle(self) -> bool:
        return not self._demand and not self._demand_busy and self._idle_busy < IDLE_DEPTH

    def _work(self) -> None:
        while (item := self._next()) is not None:
            batch, job = item
            t0 = time.perf_counter()
            try:
                n, exc = self.store.run(job), None
            except BaseException as err:  # noqa: BLE001 - handed to the waiting engine thread
                n, exc = 0, err
            self._done(batch, job, n, time.perf_counter() - t0, exc)

    def _done(
        self, batch: ReadBatch, job: ReadJob, n: int, took: float, exc: BaseException | None
    ) -> None:
        with self._cv:
            res = batch.result
            res.bytes_read += n
            res.read_s += took
            res.jobs += 1
            if exc is not None and batch.error is None:
                batch.error = exc
            batch.left -= 1
            if not batch.left:
                self._finished.notify_all()
            self._busy -= 1
            if not batch.speculative:
                self._demand_busy -= 1
                if not self._demand_busy and self._speculative:
                    self._cv.notify_all()  # idle-only jobs may start now
            elif batch.idle_only:
                self._idle_busy -= 1
                if self._speculative:
                    self._cv.notify()
            if self.store.drop_after_read:
                start, end = self._to_drop.get(job.fd, (job.offset, job.offset))
                self._to_drop[job.fd] = (min(start, job.offset), max(end, job.offset + job.nbytes))
            if not self._busy:
                self._cv.notify_all()

    # -- the engine thread -----------------------------------------------------------------

    def submit(
        self, jobs: list[ReadJob], speculative: bool = False, idle_only: bool = False
    ) -> ReadBatch:
        """Queue jobs without waiting. Demand jobs go before every queued speculative one;
        `idle_only` ones (speculative) start only while no demand job is queued or running."""
        batch = ReadBatch(jobs, speculative or idle_only, idle_only)
        with self._cv:
            queue = self._speculative if batch.speculative else self._demand
            queue.extend((batch, job) for job in jobs)
            # One wake-up here; each worker that takes a job wakes the next (prefetch.py `_next`),
            # so the engine thread pays one futex call a burst, not one per job.
            self._cv.notify()
        return batch

    def promote(self, batches: list[ReadBatch]) -> None:
        """Speculative jobs that turned out to be needed: move the queued ones to the front."""
        wanted = set(map(id, batches))
        with self._cv:
            keep: collections.deque[tuple[ReadBatch, ReadJob]] = collections.deque()
            moved: list[tuple[ReadBatch, ReadJob]] = []
            for item in self._speculative:
                (moved if id(item[0]) in wanted else keep).append(item)
            self._speculative = keep
            self._demand.extendleft(reversed(moved))

    def cancel(self, batch: ReadBatch) -> bool:
        """Drop the batch's jobs not started yet. True when none had started (nothing was
        written); jobs already running still have to be waited for (`wait`)."""
        with self._cv:
            batch.cancelled = True
            queue = self._speculative if batch.speculative else self._demand
            kept = collections.deque(item for item in queue if item[0] is not batch)
            for _b, job in (item for item in queue if item[0] is batch):
                batch.cancelled_bytes += job.nbytes
                batch.left -= 1
            if batch.speculative:
                self._speculative = kept
            else:
                self._demand = kept
            if not batch.left:
                self._finished.notify_all()
            return batch.started == 0

    def finished(self, batch: ReadBatch) -> bool:
        """Every job of `batch` ran to its end without an error (none cancelled)."""
        with self._cv:
            return not batch.left and batch.result.jobs == len(batch.jobs) and batch.error is None

    def read(self, jobs: list[ReadJob]) -> ReadResult:
        """Run jobs and wait for all of them; the first failure is raised after all finish."""
        return self.wait([self.submit(jobs)])

    def wait(self, batches: list[ReadBatch]) -> ReadResult:
        """Wait for queued batches (cancelled jobs are skipped); the first failure is raised after
        all finish. wall_s: time waited."""
        t0 = time.perf_counter()
        out, error = ReadResult(), None
        with self._finished:
            for b in batches:
                while b.left:
                    self._finished.wait()
        for b in batches:
            error = error or b.error
            out.bytes_read += b.result.bytes_read
            out.read_s += b.result.read_s
            out.jobs += b.result.jobs
        if error is not None:
            raise error
        out.wall_s = time.perf_counter() - t0
        return out

    def quiesce(self) -> None:
        """Drop every queued job and wait for the running ones to finish (a device failure: the
        slots they write start over; nobody waits for the dropped batches)."""
        with self._cv:
            for batch, _job in [*self._demand, *self._speculative]:
                batch.cancelled = True
                batch.left -= 1
            self._demand.clear()
            self._speculative.clear()
            self._finished.notify_all()
            while self._busy:
                self._cv.wait()  # _done notifies once no worker is busy

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for batch, _job in [*self._demand, *self._speculative]:  # queued: never to run
                batch.cancelled = True
                batch.error = batch.error or OSError("the read pool is closed")
                batch.left -= 1
            self._demand.clear()
            self._speculative.clear()
            self._cv.notify_all()
            self._finished.notify_all()
        for t in self._threads:
            t.join()
