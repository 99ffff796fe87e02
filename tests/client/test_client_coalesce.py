"""Both clients against a real daemon: with `coalesce`, tokens that waited while the reader was
busy arrive as one event, and the stream is the same tokens and text as read one by one."""

from __future__ import annotations

import asyncio
import time

import pytest

from moed.client import Client, DoneEvent, TokenEvent
from moed.client.async_client import AsyncClient
from moed.client.inbox import merge_tokens

PROMPT = dict(prompt="The quick brown fox", raw=True, max_tokens=48, temperature=0)


async def _read(socket, coalesce: bool, stall_s: float) -> tuple[list[TokenEvent], DoneEvent]:
    async with AsyncClient(socket, timeout=30.0) as client:
        tokens, done = [], None
        async for event in client.generate(coalesce=coalesce, **PROMPT):
            if isinstance(event, TokenEvent):
                if not tokens and stall_s:
                    await asyncio.sleep(stall_s)  # a busy reader: the rest of the tokens queue up
                tokens.append(event)
            elif isinstance(event, DoneEvent):
                done = event
        return tokens, done


def _read_sync(socket, coalesce: bool, stall_s: float) -> tuple[list[TokenEvent], DoneEvent]:
    with Client(socket, timeout=30.0) as client:
        tokens, done = [], None
        for event in client.generate(coalesce=coalesce, **PROMPT):
            if isinstance(event, TokenEvent):
                if not tokens and stall_s:
                    time.sleep(stall_s)
                tokens.append(event)
            elif isinstance(event, DoneEvent):
                done = event
        return tokens, done


@pytest.mark.process
@pytest.mark.parametrize("kind", ["async", "sync"])
def test_coalesced_stream_equals_the_one_by_one_stream(daemon, kind):
    if kind == "async":
        one_by_one, done_a = asyncio.run(_read(daemon.socket, False, 0.0))
        coalesced, done_b = asyncio.run(_read(daemon.socket, True, 1.0))
    else:
        one_by_one, done_a = _read_sync(daemon.socket, False, 0.0)
        coalesced, done_b = _read_sync(daemon.socket, True, 1.0)
    assert all(len(e.ids) <= 1 for e in one_by_one)
    # The tiny model makes 48 tokens well within the second the reader slept.
    assert any(len(e.ids) > 1 for e in coalesced)
    assert len(coalesced) < len(one_by_one)
    ids = [i for e in one_by_one for i in e.ids]
    assert [i for e in coalesced for i in e.ids] == ids
    assert "".join(e.text for e in coalesced) == "".join(e.text for e in one_by_one)
    # Each event's index is where its first id sits in the completion.
    at = 0
    for event in coalesced:
        assert event.index == at
        at += len(event.ids)
    assert done_a.usage["completion_tokens"] == done_b.usage["completion_tokens"] == len(ids)


def test_merged_tokens_keep_logprobs_and_tool_calls_per_id():
    def token(index, ids, text, logprobs=None, calls=None):
        msg = {"v": 1, "type": "token", "id": "g", "index": index, "ids": ids, "text": text}
        if logprobs is not None:
            msg["logprobs"] = logprobs
        if calls:
            msg["tool_calls"] = calls
        return msg

    lp = [{"id": 5, "token": "a", "logprob": -0.5, "top": []}]
    merged = merge_tokens(
        token(3, [5], "a", lp),
        [token(4, [6], "b", [{**lp[0], "id": 6}], [{"id": "c1", "name": "f", "arguments": {}}])],
    )
    assert merged["index"] == 3 and merged["ids"] == [5, 6] and merged["text"] == "ab"
    assert [e["id"] for e in merged["logprobs"]] == [5, 6]
    assert merged["tool_calls"] == [{"id": "c1", "name": "f", "arguments": {}}]
    # A final text flush (no ids) joins the text only.
    flushed = merge_tokens(token(0, [7], "x"), [token(1, [], "y")])
    assert flushed["ids"] == [7] and flushed["text"] == "xy" and "logprobs" not in flushed
