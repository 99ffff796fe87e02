"""Grammar compiles off the engine thread, fair across clients and bounded in time.

A request with a grammar waits in its own place in the scheduler's queue while one of a few
worker threads (at a lower CPU priority than the engine) builds its grammar; the engine keeps
stepping the other rows. Jobs queue per client and workers take them in turn across clients, so
one client's many or slow schemas delay only that client's own. A job still running
`timeout_s` after it started ends its request with `schema_too_complex` at once; the compile
itself (bounded by llguidance's limits) finishes in the background and its outcome is cached.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moed.daemon.engine.grammar_compile import GrammarLimits, too_complex
from moed.daemon.platform.thread_priority import lower_this_thread
from moed.protocol import ErrorCode, ProtocolError

log = logging.getLogger("moed.engine")

JobKey = tuple[bytes, Any]  # the request's key (connection identity, request id)
# What a job gives its request: the row's grammar constraint, or the refusal.
Deliver = Callable[[JobKey, Any], None]


@dataclass(eq=False)
class _Job:
    key: JobKey
    lane: bytes  # the client it is queued for
    build: Callable[[], Any]  # runs on a worker; raises ProtocolError to refuse
    deadline: float | None = None  # set when a worker starts it
    settled: bool = False  # its request got an answer (or was cancelled): nothing more to say


class GrammarPool:
    def __init__(
        self, limits: GrammarLimits, deliver: Deliver, timed_out: Callable[[], None] = lambda: None
    ):
        self.limits = limits
        self.deliver = deliver
        self.timed_out = timed_out  # counts a job that outlived its limit
        self._cv = threading.Condition()
        self._queues: dict[bytes, deque[_Job]] = {}
        self._turns: deque[bytes] = deque()  # lanes with queued jobs, next turn first
        self._running: dict[JobKey, _Job] = {}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"moed-grammar-{n}", daemon=True)
            for n in range(limits.workers)
        ]
        self._threads.append(
            threading.Thread(target=self._watch, name="moed-grammar-timer", daemon=True)
        )
        for thread in self._threads:
            thread.start()

    def submit(self, lane: bytes, key: JobKey, build: Callable[[], Any]) -> None:
        with self._cv:
            if lane not in self._queues:
                self._queues[lane] = deque()
                self._turns.append(lane)
            self._queues[lane].append(_Job(key, lane, build))
            self._cv.notify_all()

    def cancel(self, key: JobKey) -> None:
        """The request ended: a queued job goes, a running one finishes unheard (and cached)."""
        with self._cv:
            if (job := self._running.get(key)) is not None:
                job.settled = True
                return
            for lane, queue in self._queues.items():
                kept = deque(job for job in queue if job.key != key)
                if len(kept) != len(queue):
                    self._queues[lane] = kept
                    if not kept:
                        self._drop_lane(lane)
                    return

    @property
    def queued(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        """Workers stop after their current job; queued jobs are dropped unheard (the engine
        ends their requests itself)."""
        with self._cv:
            self._closed = True
            self._queues.clear()
            self._turns.clear()
            for job in self._running.values():
                job.settled = True
            self._cv.notify_all()

    # ---- worker threads ----------------------------------------------------------------------
    def _take(self) -> _Job | None:
        """The next job, a turn per lane; None once closed (called holding the lock)."""
        while not self._closed and not self._turns:
            self._cv.wait()
        if self._closed:
            return None
        lane = self._turns[0]
        job = self._queues[lane].popleft()
        self._turns.rotate(-1)
        if not self._queues[lane]:
            self._drop_lane(lane)
        job.deadline = time.monotonic() + self.limits.timeout_s
        self._running[job.key] = job
        self._cv.notify_all()  # the timer learns the new deadline
        return job

    def _drop_lane(self, lane: bytes) -> None:
        del self._queues[lane]
        self._turns.remove(lane)

    def _work(self) -> None:
        lower_this_thread()  # a compile yields the CPU to the engine's decode steps
        while True:
            with self._cv:
                job = self._take()
            if job is None:
                return
            try:
                result: Any = job.build()
            except ProtocolError as exc:
                result = exc
            except Exception as exc:  # a bug in one grammar fails its request, not the pool
                log.exception("building the grammar of request %r failed", job.key[1])
                result = ProtocolError(ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")
            with self._cv:
                if self._running.get(job.key) is job:
                    del self._running[job.key]
                settled, job.settled = job.settled, True
            if not settled:
                self.deliver(job.key, result)

    def _watch(self) -> None:
        """Ends the requests whose compile outlived its limit (their compile runs on)."""
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                overdue = [
                    job
                    for job in self._running.values()
                    if not job.settled and job.deadline is not None and job.deadline <= now
                ]
                for job in overdue:
                    job.settled = True
                if not overdue:
                    pending = [
                        job.deadline
                        for job in self._running.values()
                        if not job.settled and job.deadline is not None
                    ]
                    self._cv.wait(min(pending) - now if pending else None)
                    continue
            for job in overdue:
                self.timed_out()
                log.warning(
                    "the grammar of request %r did not compile within %.1f s",
                    job.key[1],
                    self.limits.timeout_s,
                )
                self.deliver(
                    job.key,
                    too_complex(
                        "the grammar of this request's schema or tools did not compile within "
                        f"the daemon's grammar_timeout_s ({self.limits.timeout_s:g} s)"
                    ),
                )
