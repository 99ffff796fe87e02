"""A follower rank's control socket, so that a host's own `moed watchdog` can guard it.

On a host without the daemon, the rank binds the host's usual moed socket and answers the control
part of the protocol: `hello`, `ping`, `status` (this rank's memory and expert cache), `shed`
(shrink this rank's cache) and `shutdown` (leave the group, which the daemon then restarts).
Generation goes to rank 0; anything else is refused with a typed error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import zmq

from moed.daemon import __version__
from moed.daemon.ground.live_probe import probe_live_daemon
from moed.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    ErrorCode,
    MessageType,
    ProtocolError,
    ShedLevel,
    decode,
    encode,
    validate_request,
)
from moed.protocol import messages as wire
from moed.protocol.paths import endpoint_for, ensure_private_dir

log = logging.getLogger("moed.distributed")


class RankControl:
    """Answers control requests on its own thread; `status`, `shed` and `leave` are the rank's."""

    def __init__(
        self,
        socket_path: Path,
        rank: int,
        status: Callable[[], dict],
        shed: Callable[[float], int],
        leave: Callable[[str], None],
    ):
        self.socket_path = socket_path
        self.rank = rank
        self._status, self._shed, self._leave = status, shed, leave
        self.boot_id = uuid.uuid4().hex
        self.started_at = time.time()
        self._stop = threading.Event()
        self._leaving: str | None = None  # a shutdown's reason: leave once its reply is out
        self.context = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="rank-control", daemon=True)

    def start(self) -> None:
        ensure_private_dir(self.socket_path.parent)
        endpoint = endpoint_for(self.socket_path)
        if self.socket_path.exists():
            if probe_live_daemon(endpoint, self.context) is not None:
                raise OSError(f"a live moed already serves {self.socket_path}")
            self.socket_path.unlink(missing_ok=True)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(endpoint)
        os.chmod(self.socket_path, 0o600)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.socket_path.unlink(missing_ok=True)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(100):
                    identity, *body = self.router.recv_multipart()
                    if len(body) == 1:
                        self.router.send_multipart([identity, encode(self._answer(body[0]))])
                    if self._leaving is not None:
                        # Leaving ends the process at once: give the IO thread the reply first.
                        time.sleep(0.1)
                        reason, self._leaving = self._leaving, None
                        self._leave(reason)
        finally:
            self.router.close(linger=0)

    def _answer(self, frame: bytes) -> dict:
        request_id = None
        try:
            msg = decode(frame, MAX_FRAME_BYTES)
            request_id = msg.get("id") if isinstance(msg, dict) else None
            kind, request_id = validate_request(msg)
            return self._dispatch(kind, msg)
        except ProtocolError as exc:
            return wire.refusal(request_id, exc)
        except Exception as exc:  # a bad request must not take the rank (and its group) down
            log.exception("control request failed")
            return wire.error(request_id, ErrorCode.INTERNAL, str(exc))

    def _dispatch(self, kind: MessageType, msg: dict) -> dict:
        req_id = msg["id"]
        if kind is MessageType.HELLO:
            return wire.welcome(
                req_id,
                protocol={"major": PROTOCOL_MAJOR, "minor": PROTOCOL_MINOR},
                boot_id=self.boot_id,
                pid=os.getpid(),
                version=__version__,
                state="ready",
                model={"pipeline_rank": self.rank},
                limits={"max_frame_bytes": MAX_FRAME_BYTES, "max_pending": 0},
            )
        if kind is MessageType.PING:
            return wire.result(req_id, pong=True, boot_id=self.boot_id, pid=os.getpid())
        if kind is MessageType.STATUS:
            return wire.result(req_id, **self.status_body())
        if kind is MessageType.SHED:
            level = ShedLevel(msg.get("level") or ShedLevel.CACHE.value)
            released = self._shed(0.5)
            log.warning("rank %d shed its expert cache (%d bytes)", self.rank, released)
            return wire.result(req_id, accepted=True, level=level.value, released_bytes=released)
        if kind is MessageType.SHUTDOWN:
            self._leaving = msg.get("reason") or "shutdown requested"
            return wire.result(req_id, accepted=True)
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"this socket is rank {self.rank} of a pipeline: send {kind.value} to rank 0's daemon",
        )

    def status_body(self) -> dict:
        rank = self._status()
        # The watchdog's fields: a follower is never `busy` on its own (rank 0's watchdog judges
        # the group's progress; a frozen rank is caught by its missing heartbeats).
        return {
            "state": "ready",
            "pid": os.getpid(),
            "boot_id": self.boot_id,
            "version": __version__,
            "busy": False,
            "active_requests": 0,
            "rss_bytes": rank.get("rss_bytes"),
            "uptime_s": time.time() - self.started_at,
            "ranks": [rank],
        }
