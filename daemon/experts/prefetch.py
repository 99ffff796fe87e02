"""Prefetch workers: a thread pool that runs a layer's read jobs in parallel.

Workers only call `os.preadv` into slot memory (the GIL is released during the read); every MLX
call stays on the engine thread.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .store import ExpertStore, ReadJob


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
        t0 = time.perf_counter()
        out = ReadResult()
        if not jobs:
            return out
        if len(jobs) == 1 or self.workers == 1:
            results = [self._timed(j) for j in jobs]
        else:
            futures = [self._pool.submit(self._timed, j) for j in jobs]
            results, error = [], None
            for f in futures:
                try:
                    results.append(f.result())
                except BaseException as exc:  # noqa: BLE001 - re-raised below once all are done
                    error = error or exc
            if error is not None:
                raise error
        for n, s in results:
            out.bytes_read += n
            out.read_s += s
        out.wall_s = time.perf_counter() - t0
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
