"""Every request gets one answer, in time: a request whose response has not started within the
deadline is cancelled (in the daemon too) and answered with a 504 in its API's shape, and a client
that hangs up before its answer starts cancels its request at once, so a request nobody waits for
never holds a connection, a slot or a generation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, ErrorKind


class AnswerDeadline:
    def __init__(
        self, app: ASGIApp, deadline_s: float, render: Callable[[str, ApiError], Response]
    ):
        self.app = app
        self.deadline_s = deadline_s
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # One reader of the connection: the app reads what it forwards, and the moment the client
        # leaves is seen even while the app waits on the daemon.
        inbox: asyncio.Queue[Message | Exception] = asyncio.Queue()
        gone = asyncio.Event()
        started = False

        async def pump() -> None:
            while True:
                try:
                    message = await receive()
                except Exception as exc:  # the body limit's refusal: the app's to raise
                    inbox.put_nowait(exc)
                    return
                inbox.put_nowait(message)
                if message["type"] == "http.disconnect":
                    gone.set()
                    return

        async def forwarded() -> Message:
            item = await inbox.get()
            if isinstance(item, Exception):
                raise item
            if item["type"] == "http.disconnect":
                inbox.put_nowait(item)  # as uvicorn's receive: every later call sees it too
            return item

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        pumping = asyncio.create_task(pump())
        # ensure_future: an ASGI app's call is typed Awaitable (a coroutine in practice).
        answering = asyncio.ensure_future(self.app(scope, forwarded, tracked_send))
        leaving = asyncio.create_task(gone.wait())
        try:
            done, _ = await asyncio.wait(
                {answering, leaving}, timeout=self.deadline_s, return_when=asyncio.FIRST_COMPLETED
            )
            if answering in done or started:
                await answering  # a streamed answer runs on; it ends itself if the client leaves
                return
            answering.cancel()  # the generator's cleanup sends the daemon a cancel
            with contextlib.suppress(asyncio.CancelledError):
                await answering
            if leaving in done or started:
                return  # nobody to answer, or the answer began while it was being cancelled
            err = ApiError(
                ErrorKind.TIMEOUT, f"no answer from the daemon within {self.deadline_s:g}s"
            )
            await self.render(scope["path"], err)(scope, forwarded, send)
        finally:
            pumping.cancel()
            leaving.cancel()
            if not answering.done():  # this task itself was cancelled (server shutdown)
                answering.cancel()
