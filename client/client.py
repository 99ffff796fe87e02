"""The synchronous client: handshake, streamed generations, control calls, heartbeats.

One DEALER socket; replies are matched to requests by id, so a `cancel` can be sent while a stream
is being read. A dead daemon surfaces as DaemonUnavailable (at once when its process exits, after
`dead_after_s` of missed connection heartbeats when it freezes: client/liveness.py; a long step
that delays replies is not death) and a restarted one (a ping after silence sees a new boot_id) as
DaemonRestarted; never as a hang.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from typing import Any, cast

import zmq

from moed.protocol import GenerateRequest, MessageType, encode

from .core import ClientCore, answer, read_frame
from .errors import DaemonUnavailable, RequestFailed
from .events import DoneEvent, Event, event_from_message
from .inbox import merge_tokens
from .liveness import EXIT_GRACE_S
from .requests import checked_request
from .resume import Resumption

log = logging.getLogger("moed.client")
_POLLIN = int(zmq.POLLIN)
_TOKEN = MessageType.TOKEN.value


class Client(ClientCore):
    default_name = "moed.client"

    def _init_connection_state(self) -> None:
        self._socket: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._buffered: dict[Any, collections.deque[dict[str, Any]]] = collections.defaultdict(
            collections.deque
        )
        self._streams: set[Any] = set()  # generate ids being read: only their messages are kept

    # ---- connection --------------------------------------------------------------------------
    def connect(self) -> dict[str, Any]:
        """Connect and handshake; returns the daemon's `welcome`."""
        if self.welcome is not None:
            return self.welcome
        self._socket, self._monitor = self.open_socket()
        self._poller = zmq.Poller()  # built once: the wait for the next token is the hot path
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        try:  # a handshake that fails must not leave its two sockets open (the context has 1023)
            request_id, frame = self.hello()
            self._send(frame)
            return self.welcomed(
                self._recv_for(request_id, time.monotonic() + self.timeout, heartbeat=False)
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._socket is not None:
            assert self._monitor is not None  # opened with the socket
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._socket = None
        self.welcome = None

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- control calls -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self._call(MessageType.STATUS)

    def stats(self) -> dict[str, Any]:
        return self._call(MessageType.STATS)

    def metrics(self) -> dict[str, Any]:
        return self._call(MessageType.METRICS)

    def ping(self) -> dict[str, Any]:
        return self._call(MessageType.PING)

    def cancel(self, request_id: Any) -> dict[str, Any]:
        """Cancel a generation of this client; the reply says whether it was in flight (`cancelled`)
        and how many of its tokens the daemon had already sent (`tokens_sent`)."""
        return self._call(MessageType.CANCEL, target=request_id)

    def count_tokens(self, **fields: Any) -> dict[str, Any]:
        """Prompt tokens of `prompt` or `messages` (with the chat template unless `raw`)."""
        return self._call(MessageType.COUNT_TOKENS, **fields)

    def shed(self, level: str = "cache", reason: str | None = None) -> dict[str, Any]:
        """Owner only: sends the control token the daemon keeps beside its socket."""
        return self._call(MessageType.SHED, level=level, reason=reason, token=self.owner_token())

    def prefix_cache(self, action: str = "list", model: str | None = None) -> dict[str, Any]:
        """A model's prefix KV cache (`model`; None: the started one): `list` (counters and
        entries) or `clear` (owner only: sends the control token; the engine empties both tiers
        at its next step)."""
        if action == "list":
            return self._call(MessageType.PREFIX_CACHE, action=action, model=model)
        return self._call(
            MessageType.PREFIX_CACHE, action=action, model=model, token=self.owner_token()
        )

    def models(self, action: str = "list", model: str | None = None) -> dict[str, Any]:
        """`list`: every servable model (with its context length) and the loaded ones (`moe ps`);
        `load`/`unload` `model` (a load is queued: `moe ps` shows it loading, then loaded)."""
        return self._call(MessageType.MODELS, action=action, model=model)

    def shutdown(self, reason: str | None = None, restart: bool = False) -> dict[str, Any]:
        """Drain and exit; `restart=True` exits non-zero so the service manager restarts it smaller.
        Owner only: sends the control token the daemon keeps beside its socket."""
        return self._call(
            MessageType.SHUTDOWN,
            reason=reason,
            restart=restart or None,
            token=self.owner_token(),
        )

    # ---- generation --------------------------------------------------------------------------
    def generate(
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
    ) -> Iterator[Event]:
        """Stream the events of one generation; ends after a DoneEvent or raises. Leaving the
        loop early cancels the request in the daemon.

        The generation is `request`, or `prompt` and `fields`: GenerateRequest's fields in their
        wire form (max_tokens=8, stop=["\n"], format={"type": "json"}, ...), checked here as the
        daemon checks them (a bad one raises RequestFailed with the daemon's code).

        With `resume=True`, a daemon that dies or restarts mid-stream (DaemonUnavailable,
        DaemonRestarted, or out_of_memory / shutting_down followed by a new boot) is waited for
        up to `resume_timeout_s`, and the request is resubmitted with the tokens received so far
        as `resume_ids`: the daemon continues from there, so the caller sees one stream, identical
        to an uninterrupted run for greedy decoding and for seeded sampling.

        With `coalesce`, token messages already waiting when the caller asks for the next event
        come as one TokenEvent (several `ids`, their texts joined): a reader that fell behind
        catches up in one step.
        """
        if request is None:
            request = checked_request(prompt=prompt, **fields)
        elif prompt is not None or fields:
            raise TypeError("give a request or its fields, not both")
        if not resume:
            yield from self._generate_once(request_id, request, coalesce)
            return
        state = Resumption(request, request_id, max_resumes)
        while True:
            attempt_id, attempt = state.attempt()
            try:
                for event in self._generate_once(attempt_id, attempt, coalesce):
                    seen = state.seen(event)
                    if seen is not None:
                        yield seen
                return
            except (DaemonUnavailable, RequestFailed) as exc:
                not_boot = state.interrupted(exc, self.boot_id)
                log.warning(
                    "generation interrupted (%s); resuming after %d token(s)",
                    exc,
                    len(state.received),
                )
                self._await_daemon(time.monotonic() + resume_timeout_s, not_boot, exc)

    def _await_daemon(
        self, deadline: float, not_boot: str | None, cause: Exception
    ) -> dict[str, Any]:
        """Reconnect until a daemon answers (a different one than `not_boot`, if given)."""
        saved = self.timeout
        try:
            while True:
                self.close()
                self._buffered.clear()  # replies of the old connection are void
                self.timeout = max(0.2, min(saved, deadline - time.monotonic()))
                try:
                    welcome = self.connect()
                    if not_boot is None or welcome.get("boot_id") != not_boot:
                        return welcome
                except (DaemonUnavailable, RequestFailed):
                    pass
                if time.monotonic() >= deadline:
                    raise cause
                time.sleep(0.2)
        finally:
            self.timeout = saved

    def _generate_once(
        self, request_id: Any, request: GenerateRequest, coalesce: bool
    ) -> Iterator[Event]:
        """One generate request on the current connection."""
        self.connect()
        request_id = request_id if request_id is not None else self.next_id("gen")
        self.last_request_id = request_id
        self._send(encode(request.to_wire(request_id)))
        self._streams.add(request_id)
        ended = False
        try:
            while True:
                msg = self._recv_for(request_id, None, heartbeat=True)
                if coalesce and msg.get("type") == _TOKEN:
                    msg = merge_tokens(msg, self._waiting_tokens(request_id, msg.get("channel")))
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
            self._streams.discard(request_id)
            self._buffered.pop(request_id, None)
            if not ended and self._socket is not None:
                # The caller stopped reading: stop the daemon generating for nobody.
                self._send(self.cancel_frame(request_id))

    # ---- plumbing ----------------------------------------------------------------------------
    def _call(self, kind: MessageType, **fields: Any) -> dict[str, Any]:
        self.connect()
        request_id = self.next_id(kind.value)
        self._send(self.frame(kind, request_id, **fields))
        msg = answer(self._recv_for(request_id, time.monotonic() + self.timeout, heartbeat=False))
        self._check_boot(msg.get("boot_id"))
        return msg

    def _waiting_tokens(self, request_id: Any, channel: str | None) -> list[dict[str, Any]]:
        """The token messages of `request_id` already received or waiting on the socket, up to
        its first other reply or another channel's token (the asyncio client's Inbox.take_tokens
        over this client's buffers)."""
        self._drain_waiting()
        queue = self._buffered.get(request_id)
        taken: list[dict[str, Any]] = []
        while queue and queue[0].get("type") == _TOKEN and queue[0].get("channel") == channel:
            taken.append(queue.popleft())
        return taken

    def _drain_waiting(self) -> None:
        """Every frame already on the socket into its stream's buffer, without waiting."""
        assert self._socket is not None
        while cast(int, self._socket.get(zmq.EVENTS)) & _POLLIN:  # typed int | bytes
            msg = read_frame(self._socket.recv(zmq.NOBLOCK))
            if msg is not None and msg.get("id") in self._streams:
                self._buffered[msg["id"]].append(msg)

    def _send(self, frame: bytes) -> None:
        assert self._socket is not None
        self._socket.send(frame)

    def _check_boot(self, boot_id: str | None) -> None:
        restart = self.restart_of(boot_id)
        if restart is not None:
            self.close()
            raise restart

    def _recv_for(self, request_id: Any, deadline: float | None, heartbeat: bool) -> dict[str, Any]:
        """The next message for request_id; other ids' messages are kept for their readers."""
        queue = self._buffered.get(request_id)
        if queue:
            waiting = queue.popleft()
            if not queue:
                del self._buffered[request_id]
            return waiting
        assert self._socket is not None and self._monitor is not None
        last_heard = time.monotonic()
        ping_id = None
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self.no_answer()
            if heartbeat and ping_id is None and now - last_heard > self.heartbeat_s:
                ping_id = self.next_id("hb")
                self._send(self.frame(MessageType.PING, ping_id))
            # A frame already waiting skips the poll; asking is cheaper than a zmq.Again raised
            # by a recv that finds nothing (most tokens are awaited: the daemon is the slow side).
            if cast(int, self._socket.get(zmq.EVENTS)) & _POLLIN:  # typed int | bytes
                frame = self._socket.recv(zmq.NOBLOCK)
            else:
                wait = (
                    self.heartbeat_s
                    if deadline is None
                    else min(self.heartbeat_s, max(deadline - now, 0.0))
                )
                ready = dict(self._poller.poll(int(wait * 1000) + 1))
                if self._socket in ready:
                    frame = self._socket.recv()
                elif self._monitor in ready:
                    if self._monitor.recv_multipart() and not self._socket.poll(0):
                        silent = time.monotonic() - last_heard
                        settled = time.monotonic() + EXIT_GRACE_S
                        while self.exiting(silent) and time.monotonic() < settled:
                            time.sleep(0.01)  # killed, or stopping: its state says in a moment
                        raise self.lost(silent) from None
                    continue
                else:
                    continue
            msg = read_frame(frame)
            last_heard = time.monotonic()
            if msg is None:
                continue
            msg_id = msg.get("id")
            if msg_id == ping_id:
                ping_id = None
                self._check_boot(msg.get("boot_id"))
                continue
            if msg_id == request_id:
                return msg
            if msg_id in self._streams:  # another stream of ours, read by its own iterator
                self._buffered[msg_id].append(msg)
            # Anything else is late: an earlier heartbeat's answer, an abandoned stream, a timed-out
            # call.
