"""The daemon stream that every API's request runs as.

Each API module parses its own JSON into the protocol's GenerateRequest and renders the events
back in its own wire format; only this module talks `generate` to the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import cast, overload

from moed.client import ClientError, DoneEvent, Event, ProgressEvent, TokenEvent
from moed.client.async_client import AsyncClient
from moed.protocol import GenerateRequest

from .errors import ApiError, from_client_error
from .token_budget import budget_error, check_budget
from .wire_limits import check_generate


class Finish(str, enum.Enum):
    """Why a generation ended, before each API names it its own way."""

    END = "end"  # the model's end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    STOP_SEQUENCE = "stop_sequence"  # a requested stop string matched (it is not in the text)
    TOOL_CALLS = "tool_calls"  # the model ended its turn after calling tools
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Outcome:
    """The end of a stream: why, the usage and the matched stop string."""

    finish: Finish
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None
    timings: dict
    cached_tokens: int = 0  # prompt tokens the daemon's prefix cache held (not read again)

    @classmethod
    def of(cls, done: DoneEvent, tool_calls: int = 0) -> Outcome:
        if done.finish_reason == "stop" and done.stop_sequence is None and tool_calls:
            finish = Finish.TOOL_CALLS
        elif done.finish_reason == "length":
            finish = Finish.LENGTH
        elif done.finish_reason == "cancelled":
            finish = Finish.CANCELLED
        elif done.stop_sequence is not None:
            finish = Finish.STOP_SEQUENCE
        else:
            finish = Finish.END
        usage = done.usage
        return cls(
            finish,
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
            done.stop_sequence,
            done.timings,
            int(usage.get("cached_tokens") or 0),
        )


# Before the first token, a streamed answer sends a keep-alive (an SSE comment, an Anthropic
# `ping`) after each prompt chunk and after this long without one: a client with a first-byte or
# read timeout keeps waiting while a long prompt is read.
KEEPALIVE_S = 5.0
# ... but not for a chunk that ends sooner than this after the last keep-alive (or the start): a
# write no client needs, made while the prompt's last token is computed on a few shared cores.
KEEPALIVE_GAP_S = 1.0


class Waiting(enum.Enum):
    """No token yet: the daemon is still reading the prompt (a keep-alive is due)."""

    WAITING = "waiting"


class Stream:
    """A started generation. Its first event is awaited before the HTTP response starts, so an
    error the daemon answers at once (too long, overloaded) becomes a status code, not a broken
    stream."""

    def __init__(self, events: AsyncGenerator[Event, None]):
        self._events = events
        self._pending: list[Event] = []
        self._next: asyncio.Future[Event] | None = None  # awaited across keep-alives
        self.outcome: Outcome | None = None
        self.tool_calls = 0  # calls the model made so far
        self.prompt_tokens = 0  # the prompt as the daemon tokenized it (set by start)

    @classmethod
    async def start(
        cls,
        client: AsyncClient,
        req: GenerateRequest,
        on_cancel: Callable[[], None] | None = None,
    ) -> Stream:
        """Send the generation and await its first event. Cancelled while it waits (the client
        left before the answer started, or the answer deadline passed), the generation is
        cancelled in the daemon and `on_cancel` is called.

        The daemon checks the budget as it tokenizes (`strict_max_tokens`): a prompt or
        max_tokens over a limit is its first event, a BudgetError here, and otherwise that event
        is the prompt's progress, which says how many tokens it has. Only while the model loads
        (after an idle unload) is the first event something else: then the prompt is counted
        and checked here, so that the answer starts at once and an over-long request is still
        refused before it."""
        # A long prompt's chunks give keep-alives before the first token; per-request telemetry
        # is for moe's live view (the gateway reports its own metrics). A request that names no
        # limit runs to its end of turn or the end of the context, as OpenAI's and ollama's do.
        req = replace(
            req, progress=True, telemetry_every=1 << 30, strict_max_tokens=True, open_ended=True
        )
        await check_generate(client, req)
        # Tokens that queued up while the HTTP side was busy come as one event (one chunk).
        # An async generator (AsyncClient.generate's surface says AsyncIterator): closable.
        events = cast(AsyncGenerator[Event, None], client.generate(request=req, coalesce=True))
        stream = cls(events)
        try:
            first = await anext(stream._events)
            stream._pending.append(first)
            if isinstance(first, ProgressEvent) and first.unit == "tokens":
                stream.prompt_tokens = int(first.total or 0)
            else:
                stream.prompt_tokens = (await check_budget(client, req)).prompt_tokens
        except ClientError as exc:
            raise (budget_error(exc) or from_client_error(exc)) from None
        except asyncio.CancelledError:  # the generator's cleanup sent the daemon a cancel
            if on_cancel is not None:
                on_cancel()
            raise
        except ApiError:  # counted while the model loads, and refused: not left running
            await stream.close()
            raise
        return stream

    # Waiting is yielded only with a keep-alive interval.
    @overload
    def tokens(self, keepalive_s: None = None) -> AsyncIterator[TokenEvent]: ...
    @overload
    def tokens(self, keepalive_s: float | None) -> AsyncIterator[TokenEvent | Waiting]: ...

    async def tokens(self, keepalive_s: float | None = None) -> AsyncIterator[TokenEvent | Waiting]:
        """The token events; sets `outcome` at the end. Daemon errors raise ApiError. With
        `keepalive_s`, until the first token: Waiting.WAITING when the daemon takes the request,
        after each prompt chunk that ends KEEPALIVE_GAP_S or more after the last one, and after
        `keepalive_s` without an event."""
        waiting = keepalive_s is not None
        sent_at = -KEEPALIVE_GAP_S  # the first (the daemon took the request) goes out at once
        try:
            while True:
                event = await self._next_event(keepalive_s if waiting else None)
                if waiting and (event is None or isinstance(event, ProgressEvent)):
                    if event is None or time.monotonic() - sent_at >= KEEPALIVE_GAP_S:
                        sent_at = time.monotonic()
                        yield Waiting.WAITING
                    continue
                if isinstance(event, TokenEvent):
                    waiting = False
                    self.tool_calls += len(event.tool_calls or ())
                    yield event
                elif isinstance(event, DoneEvent):
                    self.outcome = Outcome.of(event, self.tool_calls)
                    return
        except ClientError as exc:
            raise from_client_error(exc) from None
        except StopAsyncIteration:
            return
        finally:
            await self.close()

    def ended(self) -> Outcome:
        """The outcome, once `tokens` has run to the stream's DoneEvent."""
        if self.outcome is None:
            raise RuntimeError("the stream has not ended")
        return self.outcome

    async def _next_event(self, timeout: float | None) -> Event | None:
        """The next event, or None when `timeout` passed first (the event is still awaited)."""
        if self._pending:
            return self._pending.pop()
        if self._next is None:
            if timeout is None:  # after the first token: no task per token on the hot path
                return await anext(self._events)
            self._next = asyncio.ensure_future(anext(self._events))
        done, _ = await asyncio.wait({self._next}, timeout=timeout)
        if not done:
            return None
        ready, self._next = self._next, None
        return ready.result()

    async def close(self) -> None:
        """Stop reading; a generation still running is cancelled in the daemon."""
        if self._next is not None:  # its generator's cleanup sends the daemon a cancel
            self._next.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, ClientError):
                await self._next
            self._next = None
        await self._events.aclose()
