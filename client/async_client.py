"""The asyncio client: one DEALER connection shared by many concurrent generations.

The HTTP gateway serves many requests at once over one connection, so the daemon sees them side by
side and can batch them. A reader callback on the socket's file descriptor routes every reply to
its request's inbox by id (zmq.asyncio's future and poller round per frame was about a third of
the gateway's CPU per token); a dead daemon (its connection drops) or a frozen one (its
connection misses heartbeats: client/liveness.py) fails the open streams with DaemonUnavailable,
and a heartbeat task pings while streams are open so a restarted one fails them with
DaemonRestarted; never a hang, and never a false death because a long step delays a reply. The
next call reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import zmq

from moed.protocol import TERMINAL_TYPES, GenerateRequest, MessageType, encode
from moed.protocol.paths import nobody_listens

from .core import ClientCore, answer, read_frame
from .errors import (
    ClientError,
    DaemonNotRunning,
    DaemonRestarted,
    DaemonUnavailable,
    RequestFailed,
)
from .events import DoneEvent, Event, event_from_message
from .inbox import Inbox, merge_tokens
from .liveness import EXIT_GRACE_S
from .requests import checked_request
from .resume import Resumption
from .stream_slots import SlotTicket, StreamSlots

_POLLIN = int(zmq.POLLIN)  # a plain int: the flag enum's operators cost microseconds per frame


class AsyncClient(ClientCore):
    default_name = "moed.async_client"

    def _init_connection_state(self) -> None:
        self._socket: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False
        self._routes: dict[Any, Inbox] = {}  # request id -> its reader's inbox
        self._slots = StreamSlots()
        # Generations left by their callers, not yet ended in the daemon: their slot tickets.
        self._leaving: dict[Any, tuple[asyncio.TimerHandle, SlotTicket]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._connecting: asyncio.Lock | None = None
        self._last_heard = 0.0

    # ---- connection --------------------------------------------------------------------------
    async def connect(self) -> dict[str, Any]:
        """Connect and handshake once; concurrent callers share the one handshake."""
        if self.welcome is not None:
            return self.welcome
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            return await self._handshake()

    async def _handshake(self) -> dict[str, Any]:
        """`connect`'s handshake, under its lock."""
        if self.welcome is not None:  # another caller's, done while this one waited
            return self.welcome
        sock, monitor = self.open_socket()
        self._socket, self._monitor = sock, monitor
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.FD, self._read_ready)
        self._loop.add_reader(monitor.FD, self._disconnect_ready, sock, monitor)
        # ZMQ_FD is edge-triggered: reading EVENTS once arms it (else a later disconnect, as
        # a frozen daemon's missed heartbeats, may never wake the reader).
        self._disconnect_ready(sock, monitor)
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._heartbeat_loop())]
        try:
            request_id, frame = self.hello()
            welcome = self.welcomed(await self._exchange(request_id, frame))
            self._slots.reset(welcome.get("limits", {}).get("max_pending_per_client"))
            return welcome
        except DaemonUnavailable as exc:
            self._drop(None)
            # A daemon killed between the refused-connect probe and the handshake: its
            # socket refuses now, and "not running" is the truth, not "dropped".
            if not isinstance(exc, DaemonNotRunning) and nobody_listens(self.socket_path):
                raise DaemonNotRunning(
                    f"no daemon is running on {self.socket_path} (it exited or was killed "
                    "during the handshake)"
                ) from exc
            raise
        except BaseException:
            self._drop(None)
            raise

    async def close(self) -> None:
        self._drop(None)

    def _drop(self, error: ClientError | None) -> None:
        """Forget the connection; open streams end with `error` (or DaemonUnavailable)."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self._socket is not None:
            assert self._monitor is not None  # opened with the socket
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._socket.FD)
                self._loop.remove_reader(self._monitor.FD)
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._socket = self._monitor = None
        self.welcome = None
        failure = error or DaemonUnavailable(f"the connection to {self.socket_path} was closed")
        for queue in self._routes.values():
            queue.put_nowait(failure)
        self._routes.clear()
        for timer, _ in self._leaving.values():
            timer.cancel()
        self._leaving.clear()
        self._slots.reset(None)

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---- control calls -----------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        return await self._call(MessageType.STATUS)

    async def stats(self) -> dict[str, Any]:
        return await self._call(MessageType.STATS)

    async def metrics(self) -> dict[str, Any]:
        return await self._call(MessageType.METRICS)

    async def ping(self) -> dict[str, Any]:
        return await self._call(MessageType.PING)

    async def cancel(self, request_id: Any) -> dict[str, Any]:
        """Cancel a generation of this client; the reply says whether it was in flight (`cancelled`)
        and how many of its tokens the daemon had already sent (`tokens_sent`)."""
        return await self._call(MessageType.CANCEL, target=request_id)

    async def count_tokens(self, **fields: Any) -> dict[str, Any]:
        """Prompt tokens of `prompt` or `messages` (with the chat template unless `raw`)."""
        return await self._call(MessageType.COUNT_TOKENS, **fields)

    async def models(self, action: str = "list", model: str | None = None) -> dict[str, Any]:
        """The servable and loaded models (`list`), or `load`/`unload` one (Client.models)."""
        return await self._call(MessageType.MODELS, action=action, model=model)

    async def shed(self, level: str = "cache", reason: str | None = None) -> dict[str, Any]:
        """Owner only: sends the control token the daemon keeps beside its socket."""
        return await self._call(
            MessageType.SHED, level=level, reason=reason, token=self.owner_token()
        )

    async def prefix_cache(self, action: str = "list", model: str | None = None) -> dict[str, Any]:
        """A model's prefix KV cache (`model`; None: the started one): `list` (counters and
        entries) or `clear` (owner only: sends the control token; the engine empties both tiers
        at its next step)."""
        if action == "list":
            return await self._call(MessageType.PREFIX_CACHE, action=action, model=model)
        return await self._call(
            MessageType.PREFIX_CACHE, action=action, model=model, token=self.owner_token()
        )

    async def shutdown(self, reason: str | None = None, restart: bool = False) -> dict[str, Any]:
        """Drain and exit; `restart=True` exits non-zero so the service manager restarts it smaller.
        Owner only: sends the control token the daemon keeps beside its socket."""
        return await self._call(
            MessageType.SHUTDOWN,
            reason=reason,
            restart=restart or None,
            token=self.owner_token(),
        )

    async def _call(self, kind: MessageType, **fields: Any) -> dict[str, Any]:
        await self.connect()
        request_id = self.next_id(kind.value)
        msg = await self._exchange(request_id, self.frame(kind, request_id, **fields))
        self._check_boot(msg.get("boot_id"))
        return msg

    async def _exchange(self, request_id: Any, frame: bytes) -> dict[str, Any]:
        """Send one frame and wait for its one reply (an `error` or a connection failure
        raises)."""
        queue = self._open(request_id)
        try:
            self._send(frame)
            try:
                msg = await asyncio.wait_for(queue.get(), self.timeout)
            except TimeoutError:
                raise self.no_answer() from None
        finally:
            self._routes.pop(request_id, None)
        return _unwrap(msg)

    # ---- generation --------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | None = None,
        *,
        request: GenerateRequest | None = None,
        request_id: Any = None,
        resume: bool = False,
        resume_timeout_s: float = 60.0,
        max_resumes: int = 5,
        coalesce: bool = False,
        **fields: Any,
    ) -> AsyncIterator[Event]:
        """Stream one generation's events; ends after a DoneEvent or raises. Leaving the loop
        early cancels the request in the daemon. The generation is `request`, or `prompt` and
        `fields`: GenerateRequest's fields in their wire form, checked here as the daemon checks
        them.

        With `resume=True`, a daemon that dies or restarts mid-stream is waited for up to
        `resume_timeout_s` and the request resubmitted with the tokens received so far, as
        Client.generate does (client/resume.py).

        With `coalesce`, token messages already waiting when the caller asks for the next event
        come as one TokenEvent (several `ids`, their texts joined): a reader that fell behind
        catches up in one step (the gateway writes them as one HTTP chunk)."""
        if request is None:
            request = checked_request(prompt=prompt, **fields)
        elif prompt is not None or fields:
            raise TypeError("give a request or its fields, not both")
        if not resume:
            # aclosing: a caller that leaves early cancels the request now, not at collection.
            async with contextlib.aclosing(
                self._generate_once(request_id, request, coalesce)
            ) as once:
                async for event in once:
                    yield event
            return
        state = Resumption(request, request_id, max_resumes)
        while True:
            attempt_id, attempt = state.attempt()
            try:
                async with contextlib.aclosing(
                    self._generate_once(attempt_id, attempt, coalesce)
                ) as once:
                    async for event in once:
                        seen = state.seen(event)
                        if seen is not None:
                            yield seen
                return
            except (DaemonUnavailable, RequestFailed) as exc:
                not_boot = state.interrupted(exc, self.boot_id)
                await self._await_daemon(time.monotonic() + resume_timeout_s, not_boot, exc)

    async def _await_daemon(self, deadline: float, not_boot: str | None, cause: Exception) -> None:
        """Reconnect until a daemon answers (a different one than `not_boot`, if given)."""
        saved = self.timeout
        try:
            while True:
                self._drop(None)
                self.timeout = max(0.2, min(saved, deadline - time.monotonic()))
                try:
                    welcome = await self.connect()
                    if not_boot is None or welcome.get("boot_id") != not_boot:
                        return
                except (DaemonUnavailable, RequestFailed):
                    pass
                if time.monotonic() >= deadline:
                    raise cause
                await asyncio.sleep(0.2)
        finally:
            self.timeout = saved

    async def _generate_once(
        self, request_id: Any, request: GenerateRequest, coalesce: bool
    ) -> AsyncGenerator[Event, None]:  # aclosing: `generate` closes it
        """One generate request on the current connection."""
        await self.connect()
        request_id = request_id if request_id is not None else self.next_id("gen")
        # Callers behind this connection (a gateway's) take its slots in turn (stream_slots.py).
        ticket = await self._slots.acquire(f"{request.principal or ''}\0{request.caller or ''}")
        queue = self._open(request_id)
        ended = False
        try:
            self._send(encode(request.to_wire(request_id)))
            while True:
                msg = _unwrap(await queue.get())
                if coalesce and msg.get("type") == MessageType.TOKEN.value:
                    msg = merge_tokens(msg, queue.take_tokens(msg.get("channel")))
                event = event_from_message(msg)
                if isinstance(event, DoneEvent):
                    ended = True
                    yield event
                    return
                if event is not None:
                    yield event
        except RequestFailed:
            ended = True
            raise
        finally:
            self._routes.pop(request_id, None)
            if not ended and self._socket is not None and not queue.holds_end():
                # The caller went away (an HTTP client disconnected): stop generating for nobody.
                self._send(self.cancel_frame(request_id))
                self._leave(request_id, ticket)
            else:
                self._slots.release(ticket)

    # ---- plumbing ----------------------------------------------------------------------------
    def _leave(self, request_id: Any, ticket: SlotTicket) -> None:
        """Hold a cancelled generation's slot until its end arrives (or `timeout`: a daemon
        that never ends it must not keep the slot)."""
        assert self._loop is not None  # a generation ran: connected
        timer = self._loop.call_later(self.timeout, self._left, request_id)
        self._leaving[request_id] = (timer, ticket)

    def _left(self, request_id: Any) -> None:
        left = self._leaving.pop(request_id, None)
        if left is not None:
            left[0].cancel()
            self._slots.release(left[1])

    def _open(self, request_id: Any) -> Inbox:
        inbox = Inbox()
        self._routes[request_id] = inbox
        return inbox

    def _send(self, frame: bytes) -> None:
        if self._socket is None:
            raise DaemonUnavailable(f"not connected to the daemon at {self.socket_path}")
        # A DEALER with room in its pipe never blocks: send without awaiting, in order.
        self._socket.send(frame, zmq.NOBLOCK)
        # A send can consume the edge that would have woken the reader (ZMQ_FD is
        # edge-triggered): look for replies once more on the next loop turn.
        if not self._drain_scheduled:
            assert self._loop is not None  # set with the socket
            self._drain_scheduled = True
            self._loop.call_soon(self._read_ready)

    def _check_boot(self, boot_id: str | None) -> None:
        restart = self.restart_of(boot_id)
        if restart is not None:
            self._drop(restart)
            raise restart

    def _read_ready(self) -> None:
        """Route every reply waiting on the socket to its request's inbox (ZMQ_FD only says that
        something changed: read until the socket says no message is left)."""
        self._drain_scheduled = False
        sock = self._socket
        if sock is None:
            return
        routes = self._routes
        while cast(int, sock.get(zmq.EVENTS)) & _POLLIN:  # pyzmq types it int | bytes
            frame = sock.recv(zmq.NOBLOCK)
            self._last_heard = time.monotonic()
            msg = read_frame(frame)
            if msg is None:
                continue
            inbox = routes.get(msg.get("id"))
            if inbox is not None:
                inbox.put_nowait(msg)
            elif msg.get("type") in TERMINAL_TYPES and msg.get("id") in self._leaving:
                self._left(msg["id"])
            # Anything else is late: a heartbeat's answer, an abandoned stream, a timed-out call.

    def _disconnect_ready(self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        if self._socket is not sock or not cast(int, monitor.get(zmq.EVENTS)) & _POLLIN:
            return
        assert self._loop is not None  # set with the socket
        monitor.recv_multipart(zmq.NOBLOCK)
        self._loop.remove_reader(monitor.FD)
        self._read_ready()  # what the daemon sent before it went is delivered first
        # A moment for frames still in flight, then the open streams fail.
        self._loop.call_later(0.05, self._disconnected, sock)

    def _disconnected(self, sock: zmq.Socket[bytes], since: float | None = None) -> None:
        if self._socket is not sock:
            return  # already dropped (and maybe reconnected)
        assert self._loop is not None  # set with the socket
        self._read_ready()
        silent = time.monotonic() - self._last_heard
        since = time.monotonic() if since is None else since
        if self.exiting(silent) and time.monotonic() - since < EXIT_GRACE_S:
            # Killed, or stopping: its process state says in a moment (the loop keeps serving).
            self._loop.call_later(0.02, self._disconnected, sock, since)
            return
        self._drop(self.lost(silent))

    async def _heartbeat_loop(self) -> None:
        """While requests are open, ping after `heartbeat_s` of silence: a ping answered by a new
        boot_id means the daemon restarted. Silence alone fails nothing: a frozen daemon's
        connection misses its heartbeats and drops (client/liveness.py)."""
        while True:
            await asyncio.sleep(self.heartbeat_s / 2)
            if not self._routes:
                self._last_heard = time.monotonic()
                continue
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat_s:
                ping_id = self.next_id("hb")
                queue = self._open(ping_id)
                self._send(self.frame(MessageType.PING, ping_id))
                with contextlib.suppress(TimeoutError):
                    reply = await asyncio.wait_for(queue.get(), self.dead_after_s)
                    if isinstance(reply, dict):
                        with contextlib.suppress(DaemonRestarted):
                            self._check_boot(reply.get("boot_id"))
                self._routes.pop(ping_id, None)


def _unwrap(msg: dict[str, Any] | ClientError) -> dict[str, Any]:
    """A queued message (an `error` raises RequestFailed), or the connection failure that was
    queued in its place."""
    if isinstance(msg, ClientError):
        raise msg
    return answer(msg)
