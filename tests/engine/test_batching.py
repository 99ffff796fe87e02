"""Continuous batching through a real daemon: exact at any budget, cancel, crash and resume within a
batch, and a long prompt read in chunks between the decode steps of another stream."""

from __future__ import annotations

import io
import threading

import pytest

from moed.client import DoneEvent, RequestFailed, TokenEvent, TraceEvent
from moed.daemon.telemetry.trace import parse_trace
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import run_together

# An idle daemon gathers requests arriving within this window into one batch, so that every run
# of the same requests has the same batch composition.
WINDOW_MS = "1500"


def ids(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 200 + 3 for i in range(n)]


# Greedy and seeded rows of different prompt lengths (the batch pads them) in one batch.
REQUESTS = [
    {"prompt_ids": ids(5, 1)},
    {"prompt_ids": ids(9, 5)},
    {"prompt_ids": ids(5, 3), "temperature": 1.0, "top_p": 0.9, "seed": 11},
    {"prompt_ids": ids(13, 4), "temperature": 0.8, "seed": 5},
]


def batched_daemon(daemon_factory, model, *extra, env=None):
    return daemon_factory(
        model, "--max-batch", "4", "--batch-window-ms", WINDOW_MS, *extra, env=env
    )


@pytest.mark.process
def test_streaming_batch_equals_resident_batch_at_any_budget(daemon_factory, tiny_model):
    resident = batched_daemon(daemon_factory, tiny_model, "--resident")
    expected = [got for got, _ in run_together(resident, REQUESTS)]
    with resident.client() as c:
        assert c.status()["peak_running_requests"] == len(REQUESTS)  # really one batch
    resident.stop()
    assert all(len(got) >= 4 for got in expected), expected
    for budget in ("1", "25%", "100%"):  # "1" byte: the smallest pool, multi-pass reads
        d = batched_daemon(daemon_factory, tiny_model, "--cache-budget", budget)
        results = run_together(d, REQUESTS)
        with d.client() as c:
            assert c.status()["peak_running_requests"] == len(REQUESTS)
        assert [got for got, _ in results] == expected, budget
        if budget == "1":
            assert all(done.telemetry["experts"]["misses"] > 0 for _, done in results)
        d.stop()


@pytest.mark.process
def test_cancel_in_a_batch_ends_only_that_stream(daemon_factory, tiny_model):
    d = batched_daemon(daemon_factory, tiny_model, "--resident")
    # The victim runs long, so the cancel lands while it still generates (40 tokens took 60 ms).
    victim = {**REQUESTS[1], "max_tokens": 1000}
    expected = run_together(d, [REQUESTS[0], victim, REQUESTS[2]], max_tokens=40)
    replies = {}

    def cancel_second(c, event_count: int) -> None:
        if event_count == 3:
            replies["cancel"] = c.cancel("victim")

    results: list = [None] * 3
    ready = threading.Barrier(3)

    def worker(n: int) -> None:
        got, seen = [], 0
        with d.client() as c:
            c.connect()
            ready.wait()
            rid = "victim" if n == 1 else f"r{n}"
            request = victim if n == 1 else REQUESTS[n]
            for event in c.generate(**{"max_tokens": 40, **request}, request_id=rid):
                if isinstance(event, TokenEvent):
                    got += event.ids
                    seen += 1
                    if n == 1:
                        cancel_second(c, seen)
                elif isinstance(event, DoneEvent):
                    results[n] = (got, event)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    got, done = results[1]
    assert replies["cancel"]["cancelled"] is True and done.finish_reason == "cancelled", (
        replies,
        done,
    )
    assert done.usage["completion_tokens"] <= replies["cancel"]["tokens_sent"] + 2
    assert got == expected[1][0][: len(got)]
    # The other rows of the batch run on, unchanged.
    assert [results[0][0], results[2][0]] == [expected[0][0], expected[2][0]]


@pytest.mark.process
def test_a_crash_fails_every_request_of_the_batch_and_each_resumes(
    daemon_factory, tiny_model, tmp_path
):
    clean = batched_daemon(daemon_factory, tiny_model, "--resident")
    expected = [got for got, _ in run_together(clean, REQUESTS)]
    clean.stop()
    # An out-of-memory failure (as MLX raises after a Metal command-buffer failure) mid-batch.
    crashing = batched_daemon(
        daemon_factory, tiny_model, "--resident", env={"MOED_DEBUG_FAULTS": "oom_after=10"}
    )
    failed = run_together(crashing, REQUESTS)
    assert [type(err) for _, err in failed] == [RequestFailed] * len(REQUESTS)
    assert {err.code for _, err in failed} == {ErrorCode.OUT_OF_MEMORY}
    assert crashing.proc.wait(30) != 0
    partial = [got for got, _ in failed]
    assert all(got == want[: len(got)] for got, want in zip(partial, expected))
    assert sum(map(len, partial)) >= 10
    again = batched_daemon(daemon_factory, tiny_model, "--resident")
    resumed = [{**r, "resume_ids": got} for r, got in zip(REQUESTS, partial)]
    rest = run_together(again, resumed)
    assert [p + got for p, (got, _) in zip(partial, rest)] == expected


@pytest.mark.process
@pytest.mark.parametrize("chunk", [256])
def test_a_long_prompt_is_read_between_decode_steps_of_another_stream(
    chunk, daemon_factory, tiny_model
):
    """While another client's ~1900-token prompt is read, a decoding stream gets a step after every
    chunk: the long request's router trace (every forward pass the engine ran while it was in the
    batch) shows a decode pass between each two prompt chunks. Beside a decoding stream the chunks
    are sized to cost a few decode steps (measured), never more than `prefill_chunk`."""
    d = daemon_factory(tiny_model, "--cache-budget", "100%", "--prefill-chunk", str(chunk))
    long_prompt = ids(1900, 9)
    started, done = threading.Event(), threading.Event()

    def decoder() -> None:
        with d.client() as c:
            for event in c.generate(prompt_ids=ids(5, 1), max_tokens=4000, request_id="dec"):
                if isinstance(event, TokenEvent) and event.index == 4:
                    started.set()
                if done.is_set():
                    c.cancel("dec")

    t = threading.Thread(target=decoder)
    t.start()
    assert started.wait(60)
    trace = bytearray()
    with d.client() as c:
        for event in c.generate(prompt_ids=long_prompt, max_tokens=2, trace=True):
            if isinstance(event, TraceEvent):
                trace += event.data
    done.set()
    t.join(60)
    passes = parse_trace(io.BytesIO(bytes(trace))).passes
    rows = [p.n for p in passes]
    # While the prompt is read, a decode pass has the other stream's one row; a prompt pass has
    # the chunk's rows (a last chunk of one token reads as a decode pass, then the first decode
    # pass of both rows as a chunk: hence the tolerance of one token).
    chunks, total = [], 0
    for i, n in enumerate(rows):
        if total >= len(long_prompt) - 2:
            break
        if n >= 2:
            chunks.append(i)
            total += n
    sizes = [rows[i] for i in chunks]
    # The prompt's last token is read by its first decode step, the rest in chunks of at most
    # `chunk` tokens.
    assert abs(total - (len(long_prompt) - 1)) <= 1 and max(sizes) <= chunk, sizes
    assert len(sizes) >= (len(long_prompt) - 1) // chunk
    # Between two chunks, the other stream decoded: it never waited for the whole prompt.
    assert all(b - a >= 2 for a, b in zip(chunks, chunks[1:])), rows


def test_prefill_chunk_beside_decoding_rows_is_steered_to_a_few_decode_steps():
    from moed.daemon.engine.batch import CHUNK_STEPS, MIN_CHUNK, ChunkSizer

    sizer = ChunkSizer(256)
    assert sizer.chunk(decoding=False) == 256  # a request alone reads full chunks
    assert sizer.chunk(decoding=True) == MIN_CHUNK  # nothing measured yet: the smallest
    sizer.measured(0.002, decoded=True, prompt_tokens=0)  # a decode step: 2 ms
    # A chunk that cost far less than CHUNK_STEPS decode steps grows (at most doubling).
    sizer.measured(0.002 + 0.001, decoded=True, prompt_tokens=MIN_CHUNK)
    assert sizer.chunk(decoding=True) == 2 * MIN_CHUNK
    # One that cost far more shrinks (at most halving), never below MIN_CHUNK.
    for _ in range(5):
        sizer.measured(0.002 + 0.050, decoded=True, prompt_tokens=sizer.size)
    assert sizer.chunk(decoding=True) == MIN_CHUNK
    # At the target cost the size holds.
    sizer.size = 40
    sizer.measured(0.002 + CHUNK_STEPS * 0.002, decoded=True, prompt_tokens=40)
    assert sizer.chunk(decoding=True) == 40
    # Never above prefill_chunk.
    for _ in range(10):
        sizer.measured(0.002 + 1e-5, decoded=True, prompt_tokens=sizer.size)
    assert sizer.chunk(decoding=True) == 256 and sizer.chunk(decoding=False) == 256
