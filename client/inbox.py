"""One request's replies in the asyncio client, and the merge of token messages already waiting.

A plain deque and one waiter future: the reader hands a reply over without the locks and getter
lists of asyncio.Queue, and the consumer can take every token already waiting at once (a reader
that fell behind catches up in one step instead of one wake-up per token).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from moed.protocol import TERMINAL_TYPES, MessageType

_TOKEN = MessageType.TOKEN.value


class Inbox:
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()  # replies, or a ClientError
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def holds_end(self) -> bool:
        """Whether the stream's end (`done` or `error`) already waits here, unread."""
        return any(isinstance(m, dict) and m.get("type") in TERMINAL_TYPES for m in self._items)

    def take_tokens(self, channel: str | None = None) -> list[dict[str, Any]]:
        """The token messages at the head of the inbox (up to the first other reply, or the
        first of another channel: reasoning and answer are never merged)."""
        items, taken = self._items, []
        while (
            items
            and isinstance(items[0], dict)
            and items[0].get("type") == _TOKEN
            and items[0].get("channel") == channel
        ):
            taken.append(items.popleft())
        return taken


def merge_tokens(first: dict[str, Any], more: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive `token` messages of one stream as one (PROTOCOL.md: `ids` is a list and the
    texts concatenate; `logprobs` has one entry per id): the index is the first one's."""
    if not more:
        return first
    ids, texts = list(first["ids"]), [first["text"]]
    logprobs = list(first["logprobs"]) if first.get("logprobs") is not None else None
    calls = list(first.get("tool_calls") or ())
    for msg in more:
        ids.extend(msg["ids"])
        texts.append(msg["text"])
        if msg.get("logprobs") is not None:
            logprobs = (logprobs or []) + list(msg["logprobs"])
        calls.extend(msg.get("tool_calls") or ())
    merged = {**first, "ids": ids, "text": "".join(texts)}
    if logprobs is not None:
        merged["logprobs"] = logprobs
    if calls:
        merged["tool_calls"] = calls
    return merged
