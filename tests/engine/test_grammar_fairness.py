"""One client's grammars never stall another's stream, and clients take rows in turn: grammars
compile on a few low-priority threads (a request waits in its place meanwhile), each bounded in
size and time with a typed error past either, a schema sent again is not compiled again (nor is
a refused one); behind one connection that serves many (the gateway), the `caller` each request
names gets its own turn. Real daemons, real sockets; orderings and generous bounds, as a loaded
two-core machine allows."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from moed.client import RequestFailed, TokenEvent
from moed.client.async_client import AsyncClient
from moed.daemon.engine.scheduler import BatchLimits, FairBatchScheduler
from moed.protocol import ErrorCode

pytestmark = pytest.mark.timeout(600)


def wide_schema(tag: str, fields: int, tail: dict | None = None) -> dict:
    """A legal schema of `fields` required bounded integers (about 80 bytes each, and about a
    second per 1000 fields to compile here); `tail`, a required last property, can make it one
    that llguidance refuses after compiling everything before it."""
    props: dict = {
        f"{tag}_{i}": {"type": "integer", "minimum": i * 7919, "maximum": i * 7919 + 123456789}
        for i in range(fields)
    }
    if tail is not None:
        props["zz"] = tail
    return {"type": "object", "properties": props, "required": list(props)}


UNSATISFIABLE = {"type": "integer", "minimum": 5, "maximum": 1}
ANSWER = [{"role": "user", "content": "a record"}]


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "schema": schema}


async def _stream_gaps(c: AsyncClient, stop: threading.Event) -> tuple[float, int]:
    """Client A: one request after another until `stop`; the longest wait between two tokens
    (a request's first counted from its sending) and the tokens received."""
    longest, count = 0.0, 0
    while not stop.is_set():
        last = time.monotonic()
        async for event in c.generate(prompt_ids=[5, 17, 33], max_tokens=120):
            if isinstance(event, TokenEvent) and event.ids:
                now = time.monotonic()
                longest, last = max(longest, now - last), now
                count += len(event.ids)
            if stop.is_set():
                break
    return longest, count


async def _schemas(c: AsyncClient, legal: list[dict], refused: list[dict], resends: int):
    """Client B: every legal schema at once, and every refused one resent as soon as it fails."""

    async def one(schema: dict) -> str:
        try:
            async for _ in c.generate(messages=ANSWER, format=fmt(schema), max_tokens=2):
                pass
            return "done"
        except RequestFailed as exc:
            return exc.code.value

    async def again(schema: dict) -> list[str]:
        return [await one(schema) for _ in range(resends)]

    results = await asyncio.gather(*(one(s) for s in legal), *(again(s) for s in refused))
    return results[: len(legal)], results[len(legal) :]


@pytest.mark.process
def test_a_stream_flows_while_another_client_sends_big_and_refused_schemas(
    daemon_factory, tiny_model
):
    # 8 legal schemas of about 120 KB and 8 refused ones (each compiled whole before llguidance
    # refuses it), resent three times: on the engine thread they would stop every stream for
    # their whole compile (10 s or more here, all at once).
    legal = [wide_schema(f"ok{n}", 1500) for n in range(8)]
    refused = [wide_schema(f"no{n}", 2000, UNSATISFIABLE) for n in range(8)]
    d = daemon_factory(tiny_model, "--resident", env={"MOED_GRAMMAR_TIMEOUT_S": "300"})

    async def run() -> tuple[float, int, list, list, float]:
        stop = threading.Event()
        async with AsyncClient(d.socket) as a, AsyncClient(d.socket) as b:
            flowing = asyncio.ensure_future(_stream_gaps(a, stop))
            await asyncio.sleep(1.0)  # A is streaming before B starts
            started = time.monotonic()
            legal_out, refused_out = await _schemas(b, legal, refused, resends=3)
            took = time.monotonic() - started
            stop.set()
            longest, count = await flowing
        return longest, count, legal_out, refused_out, took

    longest, count, legal_out, refused_out, took = asyncio.run(run())
    assert legal_out == ["done"] * len(legal)
    assert refused_out == [[ErrorCode.INVALID_SCHEMA.value] * 3] * len(refused)
    assert took > 3.0, "B's compiles were too quick to stall anything: make the schemas larger"
    # The bound is generous (a loaded machine); the compiles on the engine thread took longer.
    assert longest < 3.0, f"A waited {longest:.1f} s between tokens while B's {took:.1f} s ran"
    assert count > 0
    with d.client() as c:
        grammars = c.status()["grammars"]
    # Each distinct schema compiled once; the resent refusals came from the cache.
    assert grammars["compiles"] == len(legal) + len(refused)
    assert grammars["refused"] == len(refused)
    assert grammars["cache_hits"] >= 2 * len(refused)
    assert grammars["timeouts"] == 0


@pytest.mark.process
def test_grammar_limits_are_typed_errors_and_a_slow_compile_is_kept(daemon_factory, tiny_model):
    capped = daemon_factory(tiny_model, "--resident", env={"MOED_MAX_SCHEMA_BYTES": "65536"})
    with capped.client() as c:
        with pytest.raises(RequestFailed) as large:  # about 160 KB: over the size cap
            list(c.generate(messages=ANSWER, format=fmt(wide_schema("big", 2000)), max_tokens=2))
        assert large.value.code is ErrorCode.SCHEMA_TOO_COMPLEX
        assert "max_schema_bytes" in large.value.message and not large.value.retryable
        events = list(c.generate(messages=ANSWER, format=fmt(wide_schema("s", 10)), max_tokens=2))
        assert events[-1].finish_reason in ("stop", "length")
    capped.stop()
    d = daemon_factory(tiny_model, "--resident", env={"MOED_GRAMMAR_TIMEOUT_S": "0.05"})
    with d.client() as c:
        slow = fmt(wide_schema("slow", 800))  # under the cap, compiles for longer than 50 ms
        with pytest.raises(RequestFailed) as timed_out:
            list(c.generate(messages=ANSWER, format=slow, max_tokens=2))
        assert timed_out.value.code is ErrorCode.SCHEMA_TOO_COMPLEX
        assert "grammar_timeout_s" in timed_out.value.message
        # The compile runs on and its outcome is kept: sent again (and again while it still
        # compiles: those wait for it, never compile it twice), the same schema is served.
        deadline, failures = time.monotonic() + 120, 1
        while True:
            try:
                events = list(c.generate(messages=ANSWER, format=slow, max_tokens=2))
                break
            except RequestFailed as exc:
                assert exc.code is ErrorCode.SCHEMA_TOO_COMPLEX and time.monotonic() < deadline
                failures += 1
        assert events[-1].finish_reason in ("stop", "length")
        grammars = c.status()["grammars"]
        assert grammars["compiles"] == 1 and grammars["timeouts"] == failures
        assert grammars["cache_hits"] >= 1
        # The daemon serves everyone else as before.
        plain = list(c.generate(prompt_ids=[5, 17, 33], max_tokens=4))
        assert plain[-1].finish_reason == "length"


@pytest.mark.process
def test_callers_behind_one_connection_take_rows_in_turn(daemon_factory, tiny_model):
    """One connection (as the gateway's) with a caller's ten queued streams, then another
    caller's one: with one row, the second caller's runs second, not eleventh."""
    # Steps a little slower, so the first stream is still running when it is let go.
    slow = {"MOED_DEBUG_FAULTS": "step_delay_ms=10"}
    d = daemon_factory(tiny_model, "--resident", "--max-batch", "1", env=slow)

    async def run() -> list[str]:
        order: list[str] = []
        release = asyncio.Event()

        async def stream(name: str, caller: str, max_tokens: int) -> None:
            # This chat runs past 3000 tokens on the tiny model (no end of sequence).
            chat = [{"role": "user", "content": "The quick brown fox"}]
            async for event in c.generate(messages=chat, max_tokens=max_tokens, caller=caller):
                if isinstance(event, TokenEvent) and event.ids and name not in order:
                    order.append(name)
                if name == "x" and release.is_set():
                    break  # leaving the loop cancels it: the row is free

        async with AsyncClient(d.socket) as c:
            first = asyncio.ensure_future(stream("x", "heavy", 4000))  # holds the one row
            while not order:
                if first.done():
                    first.result()  # it failed: say why
                await asyncio.sleep(0.01)
            heavy = [asyncio.ensure_future(stream(f"b{n}", "heavy", 4)) for n in range(10)]
            await asyncio.sleep(0.5)  # all ten are queued before the other caller's
            light = asyncio.ensure_future(stream("a", "light", 4))
            await asyncio.sleep(0.5)
            release.set()
            await asyncio.gather(first, *heavy, light)
        return order

    order = asyncio.run(run())
    assert sorted(order) == sorted(["x", "a", *(f"b{n}" for n in range(10))])
    assert order.index("a") <= 2, order  # after the running one and at most one queued before it


def test_the_scheduler_passes_over_a_compiling_request_and_serves_the_idle_client_first():
    sched = FairBatchScheduler(BatchLimits(max_batch=3, kv_tokens=10_000))
    sched.add((b"a", 0), b"a", 10, ready=False)  # its grammar compiles
    sched.add((b"a", 1), b"a", 10)
    sched.add((b"b", 0), b"b", 10, ready=False)
    assert sched.schedule().admit == ((b"a", 1),)  # a's ready one goes; the others hold places
    sched.ready((b"a", 0))
    sched.ready((b"b", 0))
    sched.add((b"a", 2), b"a", 10)
    # b holds no row, a holds one: b's request joins first, though a's waited longer.
    assert sched.schedule().admit == ((b"b", 0), (b"a", 0))
    lone = FairBatchScheduler(BatchLimits(max_batch=3, kv_tokens=10_000, window_s=5.0))
    lone.add((b"c", 0), b"c", 10, 0.0, ready=False)
    assert lone.wake_in(0.0) is None  # nothing can join until its grammar is built
    assert lone.schedule(10.0).admit == ()
    lone.ready((b"c", 0))
    assert lone.schedule(10.0).admit == ((b"c", 0),)
