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
from concurrent.futures import Future
from dataclasses import dataclass

from moed.daemon.experts.store import ExpertStore, ReadJob, drop_cached

# Measured with `moed bench stream --sweep` (BENCHMARKS.md): with 1 MiB chunks, 8 workers read a
# layer's misses at 0.8 of raw parallel pread where 4 workers stayed near 0.6.
DEFAULT_WORKERS = 8


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


class ReadPool:
    def __init__(self, store: ExpertStore, workers: int = 0):
        self.store = store
        self.workers = workers if workers > 0 else default_workers(store.bypass)
        self._cv = threading.Condition()
        self._demand: collections.deque[tuple[Future, ReadJob]] = collections.deque()
        self._speculative: collections.deque[tuple[Future, ReadJob]] = collections.deque()
        self._to_drop: dict[
            int, tuple[int, int]
        ] = {}  # fd -> (start, end) read since the last drop
        self._busy = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"moed-read-{i}", daemon=True)
            for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    # -- workers ---------------------------------------------------------------------------

    def _next(self) -> tuple[Future, ReadJob] | None:
        with self._cv:
            while True:
                queue = self._demand or self._speculative
                if queue:
                    fut, job = queue.popleft()
                    if fut.set_running_or_notify_cancel():
                        self._busy += 1
                        return fut, job
                    continue  # cancelled while queued
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

    def _work(self) -> None:
        while (item := self._next()) is not None:
            fut, job = item
            t0 = time.perf_counter()
            try:
                n = self.store.run(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting engine thread
                self._done(job)
                fut.set_exception(exc)
                continue
            self._done(job)
            fut.set_result((n, time.perf_counter() - t0))

    def _done(self, job: ReadJob) -> None:
        with self._cv:
            self._busy -= 1
            if self.store.drop_after_read:
                start, end = self._to_drop.get(job.fd, (job.offset, job.offset))
                self._to_drop[job.fd] = (min(start, job.offset), max(end, job.offset + job.nbytes))
            if not self._busy:
                self._cv.notify_all()

    # -- the engine thread -----------------------------------------------------------------

    def submit(self, jobs: list[ReadJob], speculative: bool = False) -> list[Future]:
        """Queue jobs without waiting. Demand jobs go before every queued speculative one."""
        futures = [Future() for _ in jobs]
        with self._cv:
            queue = self._speculative if speculative else self._demand
            queue.extend(zip(futures, jobs))
            self._cv.notify(len(jobs))
        return futures

    def promote(self, futures: list[Future]) -> None:
        """Speculative jobs that turned out to be needed: move the queued ones to the front."""
        wanted = set(map(id, futures))
        with self._cv:
            keep, moved = collections.deque(), []
            for item in self._speculative:
                (moved if id(item[0]) in wanted else keep).append(item)
            self._speculative = keep
            self._demand.extendleft(reversed(moved))

    def cancel(self, futures: list[Future]) -> bool:
        """Cancel the jobs not started yet. True when none of them had started (nothing was
        written); jobs already running still have to be waited for."""
        return all([f.cancel() for f in futures])  # a list: cancel every one, no short cut

    def read(self, jobs: list[ReadJob]) -> ReadResult:
        """Run jobs and wait for all of them; the first failure is raised after all finish."""
        return self.wait(self.submit(jobs))

    def wait(self, futures: list[Future]) -> ReadResult:
        """Wait for queued jobs (cancelled ones are skipped); the first failure is raised after
        all finish. wall_s: time waited."""
        t0 = time.perf_counter()
        out, error = ReadResult(), None
        for f in futures:
            if f.cancelled():
                continue
            try:
                n, s = f.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below once all are done
                error = error or exc
                continue
            out.bytes_read += n
            out.read_s += s
        if error is not None:
            raise error
        out.wall_s = time.perf_counter() - t0
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for _fut, _job in [*self._demand, *self._speculative]:
                _fut.cancel()
            self._cv.notify_all()
        for t in self._threads:
            t.join()
