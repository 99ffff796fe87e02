"""The one request shape every API is translated into, and the daemon stream it runs as.

Each API module parses its own JSON into a GenerationRequest and renders the events back in its
own wire format; only this module talks `generate` to the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from moed.client import ClientError, DoneEvent, Event, ProgressEvent, TokenEvent
from moed.client.async_client import AsyncClient
from moed.protocol import MessageType

from .errors import from_client_error
from .wire_limits import check_frame


class Finish(str, enum.Enum):
    """Why a generation ended, before each API names it its own way."""

    END = "end"  # the model's end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    STOP_SEQUENCE = "stop_sequence"  # a requested stop string matched (it is not in the text)
    TOOL_CALLS = "tool_calls"  # the model ended its turn after calling tools
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None  # chat turns; the daemon applies the chat template
    tools: tuple[dict, ...] | None = None  # function specs handed to the chat template
    raw: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; 0: the chosen token's; k: also the top k
    model: str | None = None
    keep_alive: int | float | str | None = None  # how long the model stays loaded once idle
    # Constrained decoding and template switches (gateway/agent_fields.py maps each API's).
    format: dict | None = None  # {type: json | json_schema, schema}
    tool_choice: str | dict | None = None  # auto | none | required | {name}
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None  # e.g. {enable_thinking: false}

    def wire_fields(self) -> dict:
        """The `generate` fields of this request (None values are left off the wire)."""
        return {
            "prompt": self.prompt,
            "prompt_ids": list(self.prompt_ids) if self.prompt_ids is not None else None,
            "messages": list(self.messages) if self.messages is not None else None,
            "tools": list(self.tools) if self.tools else None,
            "raw": self.raw or None,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop) or None,
            "logprobs": self.logprobs,
            "model": self.model,
            "keep_alive": self.keep_alive,
            "progress": True,  # a long prompt's chunks: keep-alives before the first token
            "format": self.format,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self.chat_template_kwargs,
            # Per-request telemetry is for moe's live view; the gateway reports its own metrics.
            "telemetry_every": 1 << 30,
        }


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


class Waiting(enum.Enum):
    """No token yet: the daemon is still reading the prompt (a keep-alive is due)."""

    WAITING = "waiting"


class Stream:
    """A started generation. Its first event is awaited before the HTTP response starts, so an
    error the daemon answers at once (too long, overloaded) becomes a status code, not a broken
    stream."""

    def __init__(self, events: AsyncIterator[Event]):
        self._events = events
        self._pending: list[Event] = []
        self._next: asyncio.Future | None = None  # the event being awaited across keep-alives
        self.outcome: Outcome | None = None
        self.tool_calls = 0  # calls the model made so far

    @classmethod
    async def start(
        cls,
        client: AsyncClient,
        req: GenerationRequest,
        on_cancel: Callable[[], None] | None = None,
    ) -> Stream:
        """Send the generation and await its first event. Cancelled while it waits (the client
        left before the answer started, or the answer deadline passed), the generation is
        cancelled in the daemon and `on_cancel` is called."""
        fields = req.wire_fields()
        await check_frame(client, MessageType.GENERATE, fields)
        # Tokens that queued up while the HTTP side was busy come as one event (one chunk).
        stream = cls(client.generate(coalesce=True, **fields))
        try:
            stream._pending.append(await anext(stream._events))
        except ClientError as exc:
            raise from_client_error(exc) from None
        except asyncio.CancelledError:  # the generator's cleanup sent the daemon a cancel
            if on_cancel is not None:
                on_cancel()
            raise
        return stream

    async def tokens(self, keepalive_s: float | None = None) -> AsyncIterator[TokenEvent | Waiting]:
        """The token events; sets `outcome` at the end. Daemon errors raise ApiError. With
        `keepalive_s`, until the first token: Waiting.WAITING after each prompt chunk and after
        `keepalive_s` without an event."""
        waiting = keepalive_s is not None
        try:
            while True:
                event = await self._next_event(keepalive_s if waiting else None)
                if waiting and (event is None or isinstance(event, ProgressEvent)):
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
