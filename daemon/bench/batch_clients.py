"""Concurrent clients against one daemon, and what they saw: token arrival times and ids.

`moed bench batch` drives these; the numbers come from the clients' side (the real client library
over the real socket), as a user of the service sees them. Each client is a thread of the bench
process with its own connection; none imports mlx, so they cost the daemon little CPU.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from moed.client import Client, TokenEvent

# Telemetry messages at most once per stream: the client side stays cheap (2-core machines).
QUIET_TELEMETRY = 1 << 30
STALL_LIMIT_S = 60.0


@dataclass
class StreamRecord:
    """One client's stream: when it sent, when each token arrived, the ids (and logprobs if
    asked: per token, the top alternatives)."""

    sent: float = 0.0
    stamps: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    top: list[list[dict]] = field(default_factory=list)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


@dataclass(frozen=True)
class ClientJob:
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_tokens: int = 128
    start_after: int = 0  # wait until every other stream has this many tokens (0: at once)
    logprobs: int | None = None  # ask for the top alternatives of every token (solo references)
    until_late_token: bool = False  # stop (cancel) once a late job received its first token
    format: dict | None = None  # structured output: the answer held to this format's grammar
    model: str | None = None  # the model it names (None: the daemon's started model)


def run_clients(socket: Path, jobs: list[ClientJob]) -> list[StreamRecord]:
    """Each job from its own client connection, started together (or after a token count)."""
    records = [StreamRecord() for _ in jobs]
    ready = threading.Barrier(len(jobs))
    # Set once every stream started at once has `start_after` tokens (or ended): late jobs start
    # then, so each stream's pace before them is measured (one stream alone may lead the rest).
    threshold = max(job.start_after for job in jobs)
    late_go = threading.Event()
    waiting_for = {n for n, job in enumerate(jobs) if not job.start_after}
    count_lock = threading.Lock()

    def arrived(n: int) -> None:
        with count_lock:
            waiting_for.discard(n)
            if not waiting_for:
                late_go.set()

    late_token = threading.Event()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        job, rec = jobs[n], records[n]
        try:
            # A stall is measured (the gap p99 and max), not taken for a dead daemon: on a busy
            # shared machine a daemon can go quiet longer than the client's usual 1.5 s.
            with Client(socket, timeout=600.0, dead_after_s=STALL_LIMIT_S) as c:
                c.connect()
                ready.wait()
                if job.start_after:
                    late_go.wait()
                rec.sent = time.perf_counter()
                for event in c.generate(
                    job.prompt,
                    prompt_ids=list(job.prompt_ids) if job.prompt_ids else None,
                    max_tokens=job.max_tokens,
                    raw=True,
                    telemetry_every=QUIET_TELEMETRY,
                    logprobs=job.logprobs,
                    format=job.format,
                    model=job.model,
                ):
                    if isinstance(event, TokenEvent) and event.ids:
                        rec.stamps.append(time.perf_counter())
                        rec.tokens.extend(event.ids)
                        if event.logprobs:
                            rec.top.extend(entry["top"] for entry in event.logprobs)
                        if len(rec.tokens) >= threshold and n in waiting_for:
                            arrived(n)
                        if job.start_after:
                            late_token.set()
                        elif job.until_late_token and late_token.is_set():
                            break  # leaving the stream cancels the request
        except BaseException as exc:  # reported by the caller, after every thread ended
            errors.append(exc)
            exc.add_note(f"client {n} of {len(jobs)}, {len(rec.tokens)} tokens received")
            ready.abort()  # the others must not wait for this one at the barrier
        finally:
            arrived(n)
            if job.start_after:
                late_token.set()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return records


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 1]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass(frozen=True)
class CellResult:
    """One run of n concurrent clients, as they saw it."""

    total_tps: float  # every token of every client / wall time, first send to last token
    per_client_tps: float  # mean over clients of tokens / (last token - send)
    gaps_ms: tuple[float, ...]  # between consecutive tokens of one stream, pooled over streams
    ttft_ms: tuple[float, ...]  # one per client
    tokens: int


def summarize(records: list[StreamRecord]) -> CellResult:
    streams = [r for r in records if r.stamps]
    if not streams:
        raise ValueError("no client received a token")
    start = min(r.sent for r in records)
    end = max(r.stamps[-1] for r in streams)
    tokens = sum(len(r.tokens) for r in records)
    return CellResult(
        total_tps=tokens / (end - start),
        per_client_tps=statistics.mean(len(r.tokens) / (r.stamps[-1] - r.sent) for r in streams),
        gaps_ms=tuple(g * 1000 for r in streams for g in r.gaps()),
        ttft_ms=tuple((r.stamps[0] - r.sent) * 1000 for r in streams),
        tokens=tokens,
    )


@dataclass(frozen=True)
class LongPromptResult:
    """Decoding streams while another client's long prompt is read (send to its first token)."""

    median_gap_ms: float  # the decoding streams' gaps outside the reading window
    # Their time per token before the prompt arrived (median over streams): unlike the median gap
    # it holds when a busy machine delivers tokens in pairs (a gap near 0, then a double one).
    base_gap_ms: float
    window_p50_ms: float  # their gaps that overlap the window: a step that also read a chunk
    window_p99_ms: float  # their gaps that overlap the window (p99 ~ the largest)
    window_max_ms: float
    window_gaps: int
    stream_p99_ms: float  # over the streams' whole runs
    long_ttft_ms: float
    covered: bool  # every stream kept decoding until the long prompt's first token


def long_prompt_effect(streams: list[StreamRecord], long: StreamRecord) -> LongPromptResult:
    begin, end = long.sent, long.stamps[0]
    inside: list[float] = []
    outside: list[float] = []
    for r in streams:
        for a, b in zip(r.stamps, r.stamps[1:]):
            (inside if b > begin and a < end else outside).append((b - a) * 1000)
    every = inside + outside
    return LongPromptResult(
        median_gap_ms=statistics.median(outside),
        base_gap_ms=statistics.median(_time_per_token(r.stamps, begin) for r in streams),
        window_p50_ms=percentile(inside, 0.5),
        window_p99_ms=percentile(inside, 0.99),
        window_max_ms=max(inside, default=0.0),
        window_gaps=len(inside),
        stream_p99_ms=percentile(every, 0.99),
        long_ttft_ms=(end - begin) * 1000,
        covered=all(r.stamps[-1] > end for r in streams),
    )


def _time_per_token(stamps: list[float], before: float) -> float:
    early = [t for t in stamps if t <= before]
    if len(early) < 2:
        return 0.0
    return (early[-1] - early[0]) / (len(early) - 1) * 1000
