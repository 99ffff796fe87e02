"""Prefetch workers: a thread pool that runs a layer's read jobs in parallel.

Workers only call `os.preadv` into slot memory (the GIL is released during the read); every MLX
call stays on the engine thread.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from moed.daemon.experts.store import ExpertStore, ReadJob


def default_workers() -> int:
    return max(2, min(8, (os.cpu_count() or 2) * 2))


@dataclass
class ReadResult:
    bytes_read: int = 0
    read_s: float = 0.0  # summed over jobs (worker time)
    wall_s: float = 0.0  # engine thread blocked


class ReadPool:
    def __init__(self, store: ExpertStore, workers: int = 0):
        self.store = store
        self.workers = workers if workers > 0 else default_workers()
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="moed-read")

    def _timed(self, job: ReadJob) -> tuple[int, float]:
        t0 = time.perf_counter()
        n = self.store.run(job)
        return n, time.perf_counter() - t0

    def read(self, jobs: list[ReadJob]) -> ReadResult:
        """Run jobs and wait for all of them; the first failure is raised after all finish."""
        if len(jobs) == 1 or self.workers == 1:
            t0 = time.perf_counter()
            out = ReadResult()
            for job in jobs:
                n, s = self._timed(job)
                out.bytes_read += n
                out.read_s += s
            out.wall_s = time.perf_counter() - t0
            return out
        return self.wait(self.submit(jobs))

    def submit(self, jobs: list[ReadJob]) -> list[Future]:
        """Queue jobs without waiting (FIFO: jobs queued earlier are read first)."""
        return [self._pool.submit(self._timed, j) for j in jobs]

    def wait(self, futures: list[Future]) -> ReadResult:
        """Wait for queued jobs; the first failure is raised after all finish. wall_s: time
        waited."""
        t0 = time.perf_counter()
        out, error = ReadResult(), None
        for f in futures:
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
        self._pool.shutdown(wait=True)
