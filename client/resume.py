"""A generation resumed across a daemon's death or restart, the same for the sync and the asyncio
client: what each attempt asks for, which of its events reach the caller, and which failures are
worth waiting out.

Each attempt is resubmitted one token short: the daemon regenerates that token, and with it any
text the detokenizer was still holding back when the stream broke; duplicates are dropped by
index. Sampling is keyed by (seed, position), so a sampled request gets a fixed seed first.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from moed.protocol import ErrorCode, GenerateRequest

from .errors import ClientError, RequestFailed
from .events import DoneEvent, Event, TokenEvent

# A daemon that says it is going away: only a new daemon (another boot) is worth resuming on.
GOING_AWAY = (ErrorCode.OUT_OF_MEMORY, ErrorCode.SHUTTING_DOWN, ErrorCode.RANK_FAILED)


class Resumption:
    """One resumable generation's state across its attempts."""

    def __init__(self, request: GenerateRequest, request_id: Any, max_resumes: int):
        if request.temperature and request.seed is None:
            request = replace(request, seed=int.from_bytes(os.urandom(7), "big"))
        self.request = request
        self.request_id = request_id
        self.max_resumes = max_resumes
        self.received = list(request.resume_ids)
        self.resumes = 0
        self._base = 0

    def attempt(self) -> tuple[Any, GenerateRequest]:
        """The next attempt's request id (the caller's only for the first) and request."""
        self._base = len(self.received)
        received = self.received
        context = received[:-1] if received and self.resumes else received
        request_id = None if self.resumes else self.request_id
        return request_id, replace(self.request, resume_ids=tuple(context))

    def seen(self, event: Event) -> Event | None:
        """The event as the caller sees it, or None for a token it already had."""
        if isinstance(event, TokenEvent):
            if event.index < self._base:
                return None
            self.received.extend(event.ids)
        elif isinstance(event, DoneEvent) and self.resumes:
            received, resumes = len(self.received), self.resumes
            usage = {**event.usage, "completion_tokens": received, "resumes": resumes}
            return replace(event, usage=usage)
        return event

    def interrupted(self, exc: ClientError, boot_id: str | None) -> str | None:
        """After a failed attempt: re-raises `exc` unless it is worth waiting out; else the boot
        the next daemon must differ from (None: any daemon will do)."""
        need_new_boot = False
        if isinstance(exc, RequestFailed):
            if exc.code not in GOING_AWAY:
                raise exc
            need_new_boot = True
        self.resumes += 1
        if self.resumes > self.max_resumes:
            raise exc
        return boot_id if need_new_boot else None
