"""Clients see a long prompt move: with `progress: true`, a `progress` message (stage
`reading the prompt`, unit `tokens`) when the daemon takes the request and after every chunk,
before the first token; the sync and asyncio clients yield them as ProgressEvent, and `moe run
--json` shows them for a prompt of several chunks. A prompt read alone under streaming takes
chunks as large as the memory plan allows (here its KV room, set small, binds them; the
configured `prefill_chunk` is smaller still). Without `progress`, no such message."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from moed.client import DoneEvent, ProgressEvent, TokenEvent
from moed.client.async_client import AsyncClient
from moed.protocol.messages import PROMPT_STAGE
from tests.fixtures.daemon_harness import moe_command

pytestmark = pytest.mark.process

CHUNK = 4  # --prefill-chunk
PLAN_TOKENS = 16  # plan_context_tokens: the lone prompt's chunk (the tiny model's activations
# per token are small, so the KV room the plan keeps binds first)
PROMPT = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"


@pytest.fixture(scope="module")
def chunked(tmp_path_factory, tiny_model):
    from tests.fixtures.daemon_harness import start_daemon

    d = start_daemon(
        tmp_path_factory.mktemp("chunks") / "d",
        tiny_model,
        "--cache-budget",  # streamed: a lone prompt's chunk grows (a resident one keeps CHUNK)
        "50%",
        "--prefill-chunk",
        str(CHUNK),
        "--prefix-cache",  # every test sends the same prompt: each must read it in chunks
        "0",
        env={"MOED_PLAN_CONTEXT_TOKENS": str(PLAN_TOKENS)},
    )
    yield d
    d.stop()


def _check_prompt_progress(events: list) -> None:
    first_token = next(i for i, e in enumerate(events) if isinstance(e, TokenEvent))
    reading = [e for e in events if isinstance(e, ProgressEvent) and e.stage == PROMPT_STAGE]
    assert all(events.index(e) < first_token for e in reading)
    total = events[-1].usage["prompt_tokens"]
    assert all(e.unit == "tokens" and e.total == total for e in reading)
    done = [e.done for e in reading]
    # From 0 when the daemon took it, up by a chunk each time, to the whole prompt; alone, every
    # chunk but the last is the plan's size, not prefill_chunk's.
    assert done[0] == 0 and done == sorted(done) and done[-1] == total
    steps = [b - a for a, b in zip(done, done[1:])]
    assert total > PLAN_TOKENS and all(0 < n <= PLAN_TOKENS for n in steps)
    assert steps[0] == PLAN_TOKENS > CHUNK


def test_the_sync_client_sees_every_chunk(chunked):
    with chunked.client() as c:
        events = list(c.generate(PROMPT, max_tokens=3, raw=True, progress=True))
    assert isinstance(events[-1], DoneEvent)
    _check_prompt_progress(events)


def test_the_async_client_sees_every_chunk(chunked):
    async def run() -> list:
        async with AsyncClient(chunked.socket) as c:
            return [
                e async for e in c.generate(prompt=PROMPT, max_tokens=3, raw=True, progress=True)
            ]

    _check_prompt_progress(asyncio.run(run()))


def test_moe_run_json_shows_a_long_prompt_being_read(chunked):
    out = subprocess.run(
        moe_command(chunked.socket, "run", "--json", "--raw", "--no-start", "--max-tokens", "2",
                    PROMPT),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    reading = [x for x in lines if x["type"] == "progress" and x["task"].endswith(PROMPT_STAGE)]
    assert reading and reading[-1]["final"] and reading[-1]["done"] == reading[-1]["total"]
    assert all(x["unit"] == "tokens" for x in reading)
    assert [x["type"] for x in lines].index("token") > lines.index(reading[-1])


def test_no_progress_messages_unless_asked(chunked):
    with chunked.client() as c:
        events = list(c.generate(PROMPT, max_tokens=2, raw=True))
    assert isinstance(events[0], TokenEvent)
    assert not any(isinstance(e, ProgressEvent) for e in events)
