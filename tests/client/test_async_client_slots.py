"""The asyncio client holds its generations to the daemon's limit per connection: past it they wait
for a slot instead of being refused as `overloaded`, and a generation its caller left keeps its
slot until the daemon has ended it (a real daemon allowing 2 per connection)."""

from __future__ import annotations

import asyncio

import pytest

from moed.client import DoneEvent, TokenEvent
from moed.client.async_client import AsyncClient
from moed.client.stream_slots import StreamSlots

PER_CLIENT = 2


@pytest.fixture
def narrow_daemon(daemon_factory, tiny_model):
    return daemon_factory(tiny_model, "--resident", env={"MOED_MAX_PENDING_PER_CLIENT": "2"})


async def _complete(client: AsyncClient, tokens: int) -> DoneEvent:
    async for event in client.generate(prompt="The", raw=True, max_tokens=tokens, temperature=0):
        if isinstance(event, DoneEvent):
            return event
    raise AssertionError("no done")


async def _leave_after_one_token(client: AsyncClient) -> None:
    async for event in client.generate(prompt="The", raw=True, max_tokens=2000, temperature=0):
        if isinstance(event, TokenEvent):
            return  # the generator is closed here: the client cancels it in the daemon


@pytest.mark.process
def test_generations_past_the_limit_wait_for_a_slot(narrow_daemon):
    async def main():
        async with AsyncClient(narrow_daemon.socket, timeout=30.0) as client:
            assert client._slots.limit == PER_CLIENT
            done = await asyncio.gather(*(_complete(client, 12) for _ in range(7)))
            assert client._slots.held == 0
            return done

    done = asyncio.run(main())
    assert [d.usage["completion_tokens"] for d in done] == [12] * 7


@pytest.mark.process
def test_a_left_generation_holds_its_slot_until_the_daemon_ends_it(narrow_daemon):
    async def main():
        async with AsyncClient(narrow_daemon.socket, timeout=30.0) as client:
            for _ in range(3):
                # Both slots are left at once and taken again at once: without the wait for the
                # daemon's end of the left ones, the new ones race their cancels (overloaded).
                await asyncio.gather(*(_leave_after_one_token(client) for _ in range(PER_CLIENT)))
                # Every slot still held is a left one the daemon has not ended yet (it may have
                # ended some already: their done came while the others waited for a token).
                assert client._slots.held == len(client._leaving)
                done = await asyncio.gather(*(_complete(client, 3) for _ in range(PER_CLIENT)))
                assert [d.usage["completion_tokens"] for d in done] == [3] * PER_CLIENT
            await asyncio.sleep(0.5)
            assert client._slots.held == 0 and not client._leaving

    asyncio.run(main())


def test_slots_wake_waiters_in_order_and_forget_a_dropped_connection():
    async def main():
        slots = StreamSlots()
        slots.reset(1)
        first = await slots.acquire()
        order: list[int] = []

        async def waiter(n: int) -> int:
            ticket = await slots.acquire()
            order.append(n)
            return ticket

        tasks = [asyncio.create_task(waiter(n)) for n in range(3)]
        await asyncio.sleep(0)
        assert not order
        slots.release(first)
        second = await tasks[0]
        assert order == [0]
        slots.reset(1)  # the connection dropped: its tickets are void, one slot is free again
        slots.release(second)  # a stale ticket gives back nothing
        await asyncio.sleep(0)
        assert order == [0, 1] and slots.held == 1
        tasks[2].cancel()
        await asyncio.gather(tasks[2], return_exceptions=True)
        slots.release(await tasks[1])
        assert slots.held == 0

    asyncio.run(main())


def test_slots_go_to_the_caller_that_holds_fewest_and_keep_one_for_a_newcomer():
    """Behind one connection (the gateway's), a caller with many generations cannot hold every
    slot: the last is kept for a caller holding none, and a freed slot goes to the waiting
    caller that holds the fewest, not to the one that asked first."""

    async def main():
        slots = StreamSlots()
        slots.reset(16)
        busy = [await slots.acquire("busy") for _ in range(15)]
        queued = asyncio.create_task(slots.acquire("busy"))  # the 16th: kept for a newcomer
        await asyncio.sleep(0)
        assert not queued.done() and slots.held == 15
        newcomer = await slots.acquire("new")  # at once, beside the busy caller's waiter
        assert slots.held == 16
        later = asyncio.create_task(slots.acquire("other"))
        await asyncio.sleep(0)
        slots.release(busy.pop())  # the busy caller asked first, the other holds none
        assert await later is not None and not queued.done()
        slots.release(newcomer)
        slots.release(busy.pop())
        await asyncio.sleep(0)
        assert queued.done()  # its turn once the others hold as many or the room is there
        for ticket in [*busy, await queued, await later]:
            slots.release(ticket)
        assert slots.held == 0

    asyncio.run(main())
