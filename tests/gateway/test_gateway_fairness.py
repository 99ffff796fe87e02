"""Fair admission at the gateway: a second address's stream starts at the next free row, not after
the first address's many queued streams, and a few busy addresses can never hold every slot (the
last are kept for clients with nothing in flight). Real daemon, real gateway, real sockets from
distinct loopback addresses; orderings, not timings."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from tests.fixtures.gateway_harness import start_gateway

pytestmark = [pytest.mark.process, pytest.mark.timeout(600)]


def _client(address: str, timeout: float = 120.0) -> httpx.AsyncClient:
    """An HTTP client whose connections come from `address` (any of 127.0.0.0/8 is loopback)."""
    return httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(local_address=address), timeout=timeout
    )


def _body(model: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": "The quick brown fox",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


async def _first_text(lines) -> bool:
    """Read SSE lines up to the first one that carries text (keep-alive comments skipped)."""
    async for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = (json.loads(line[6:]).get("choices") or [{}])[0]
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


@pytest.fixture
def stack(daemon_factory, tiny_model, tmp_path):
    # Each step a little slower (the tiny model is otherwise done in a blink), so streams
    # overlap as they would on a real model: at least 20 ms a token.
    slow = {"MOED_DEBUG_FAULTS": "step_delay_ms=20"}
    daemon = daemon_factory(tiny_model, "--resident", "--max-batch", "2", env=slow)
    with daemon.client() as c:
        model = c.welcome["model"]["name"]

    def start(*extra: str):
        return start_gateway(tmp_path / "g", daemon.socket, *extra)

    return start, model


def test_a_second_address_starts_at_the_next_free_row(stack):
    start, model = stack
    gateway = start()
    order: list[str] = []

    async def stream(http: httpx.AsyncClient, name: str, max_tokens: int) -> None:
        async with http.stream(
            "POST", f"{gateway.url}/v1/completions", json=_body(model, max_tokens)
        ) as reply:
            assert reply.status_code == 200, await reply.aread()
            lines = reply.aiter_lines()
            assert await _first_text(lines), name
            order.append(name)
            async for _ in lines:  # to its end
                pass

    async def main() -> None:
        async with _client("127.0.0.1") as first, _client("127.0.0.2") as second:
            # Two rows: the first address's streams 0 and 1 run, ten more wait their turn.
            busy = [asyncio.ensure_future(stream(first, f"a{n}", 60 + n)) for n in range(12)]
            deadline = time.monotonic() + 120
            while len(order) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert len(order) >= 2, order
            await asyncio.sleep(0.5)  # every other stream of the first address is queued
            await asyncio.gather(stream(second, "b", 8), *busy)

    try:
        asyncio.run(main())
    finally:
        gateway.stop()
    assert sorted(order) == sorted(["b", *(f"a{n}" for n in range(12))])
    # Behind the ones running when it came (two, maybe one more that took a row in the same
    # step); without fair admission it waits for every queued stream of the first address.
    assert order.index("b") <= 3, order


def test_busy_addresses_cannot_hold_every_slot(stack):
    start, model = stack
    gateway = start("--max-connections", "8", "--max-requests-per-client", "6")

    async def main() -> tuple[list[int], int, int]:
        async with contextlib.AsyncExitStack() as held:
            clients = {
                a: await held.enter_async_context(_client(a))
                for a in ("127.0.0.1", "127.0.0.2", "127.0.0.3")
            }

            # This chat runs past 3000 tokens on the tiny model (no end of sequence): a minute
            # at least, so each request stays in flight until the test ends.
            chat = {
                "model": model,
                "messages": [{"role": "user", "content": "The quick brown fox"}],
                "max_tokens": 3000,
                "stream": True,
            }

            async def open_stream(address: str) -> int:
                reply = await held.enter_async_context(
                    clients[address].stream("POST", f"{gateway.url}/v1/chat/completions", json=chat)
                )
                return reply.status_code  # a 200 starts at once, queued or running

            first = [await open_stream("127.0.0.1") for _ in range(7)]  # its cap is 6
            second = [await open_stream("127.0.0.2") for _ in range(2)]
            third = await open_stream("127.0.0.3")
            return first, second, third

    try:
        first, second, third = asyncio.run(main())
    finally:
        gateway.stop()
    assert first == [200] * 6 + [429]
    # The second address gets one; its next would take the gateway's last slot, which is kept
    # for an address with nothing in flight: the third one gets it.
    assert second == [200, 429]
    assert third == 200
