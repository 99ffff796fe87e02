"""What every route needs: the settings, the shared daemon connection, the metrics, and the two
ways a generation is consumed (streamed, or collected while watching for the client leaving)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, overload

from starlette.requests import Request

from moed.client import ClientError, TokenEvent
from moed.client.async_client import AsyncClient
from moed.protocol import Channel, GenerateRequest, MessageType

from .config import GatewayConfig
from .errors import ApiError, ErrorKind, from_client_error
from .generation import Stream, Waiting
from .limits import client_address
from .metrics import GatewayMetrics
from .principal import principal_of
from .wire_limits import check_frame

REASONING = Channel.REASONING.value


class Api(str, enum.Enum):
    """The API a path belongs to: it picks the error shape and labels the metrics."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    OLLAMA = "ollama"
    OPS = "ops"  # /health, /metrics


@dataclass(frozen=True)
class Collected:
    text: str
    logprobs: list[dict]
    ids: list[int]
    tool_calls: list[dict]
    reasoning: str = ""  # the reasoning channel's text (the think markers' contents)
    # The turn in the order it was generated: (PartKind, text or tool call), texts of one kind
    # run together (the APIs whose content is a list of blocks keep this order).
    parts: list[tuple[PartKind, Any]] = field(default_factory=list)


class PartKind(str, enum.Enum):
    REASONING = "reasoning"
    TEXT = "text"
    TOOL_CALL = "tool_call"


def _add_part(parts: list[tuple[PartKind, Any]], kind: PartKind, value: Any) -> None:
    if kind is not PartKind.TOOL_CALL and parts and parts[-1][0] is kind:
        parts[-1] = (kind, parts[-1][1] + value)
    else:
        parts.append((kind, value))


@dataclass
class Gateway:
    config: GatewayConfig
    client: AsyncClient
    metrics: GatewayMetrics

    async def model(self) -> dict:
        """The served model as the daemon's welcome describes it."""
        try:
            welcome = await self.client.connect()
        except ClientError as exc:
            raise from_client_error(exc) from None
        return welcome.get("model") or {}

    async def call(self, name: str, **fields) -> dict:
        """A control call to the daemon (status, stats, metrics, count_tokens)."""
        if fields:  # a request that carries a body (count_tokens): checked as it will be sent
            await check_frame(self.client, MessageType(name), fields)
        try:
            return await getattr(self.client, name)(**fields)
        except ClientError as exc:
            raise from_client_error(exc) from None

    async def start(self, req: GenerateRequest, api: Api, request: Request) -> Stream:
        """A started generation of `request`'s principal (its prefix-cache scope: principal.py);
        one cancelled before its first event (the client left while the daemon had not taken it
        yet) is counted as cancelled, as a stream left early is."""
        # Rows and the daemon connection's slots go in turn across callers (limits.py).
        req = replace(req, principal=principal_of(request), caller=client_address(request.scope))
        return await Stream.start(
            self.client, req, on_cancel=lambda: self.metrics.cancelled.labels(api.value).inc()
        )

    # Waiting is yielded only with a keep-alive interval.
    @overload
    def tokens(
        self, stream: Stream, api: Api, endpoint: str, started: float, keepalive_s: None = None
    ) -> AsyncIterator[TokenEvent]: ...
    @overload
    def tokens(
        self, stream: Stream, api: Api, endpoint: str, started: float, keepalive_s: float | None
    ) -> AsyncIterator[TokenEvent | Waiting]: ...

    async def tokens(
        self,
        stream: Stream,
        api: Api,
        endpoint: str,
        started: float,
        keepalive_s: float | None = None,
    ) -> AsyncIterator[TokenEvent | Waiting]:
        """A stream's tokens for an HTTP streaming body; counts TTFT, tokens, and cancellations
        (the body is closed early when the client disconnects, which cancels the generation).
        With `keepalive_s`, Waiting.WAITING marks where a keep-alive is due (generation.py)."""
        first = True
        count = 0
        try:
            async for event in stream.tokens(keepalive_s):
                if event is Waiting.WAITING:
                    yield event
                    continue
                if first and event.text:
                    first = False
                    self.metrics.ttft.labels(api.value, endpoint).observe(
                        time.perf_counter() - started
                    )
                count += len(event.ids)
                yield event
        finally:
            self.metrics.tokens.labels(api.value).inc(count)
            if stream.outcome is None:
                self.metrics.cancelled.labels(api.value).inc()

    async def collect(
        self, request: Request, stream: Stream, api: Api, endpoint: str, started: float
    ) -> Collected:
        """The whole completion for a non-streamed answer. A client that disconnects first, or a
        generation over the request timeout, cancels it in the daemon."""

        async def gather() -> Collected:
            texts: list[str] = []
            reasoning: list[str] = []
            logprobs: list[Any] = []
            ids: list[int] = []
            calls: list[dict[str, Any]] = []
            order: list[tuple[PartKind, Any]] = []
            async for event in self.tokens(stream, api, endpoint, started):
                thinking = event.channel == REASONING
                (reasoning if thinking else texts).append(event.text)
                if event.text:
                    _add_part(order, PartKind.REASONING if thinking else PartKind.TEXT, event.text)
                ids.extend(event.ids)
                logprobs.extend(event.logprobs or ())
                calls.extend(event.tool_calls or ())
                for call in event.tool_calls or ():
                    _add_part(order, PartKind.TOOL_CALL, call)
            return Collected("".join(texts), logprobs, ids, calls, "".join(reasoning), order)

        work = asyncio.create_task(gather())
        watch = asyncio.create_task(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait(
                {work, watch},
                timeout=self.config.request_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()  # the generator's cleanup sends the daemon a cancel
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work not in done:
            if watch in done:
                raise ApiError(ErrorKind.CLIENT_CLOSED, "the client closed the connection")
            raise ApiError(
                ErrorKind.UNAVAILABLE,
                f"the generation took longer than {self.config.request_timeout_s:.0f}s",
            )
        return work.result()


async def _wait_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
