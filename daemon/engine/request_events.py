"""What a request's client is sent, built from its generation: the tokens by channel segment,
telemetry when due, the prompt's and a reload's progress, and its end (`done` with usage, timings
and telemetry, or a typed failure). Typed events (protocol/events.py) into the sink; the engine
core holds one and decides when."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from moed.daemon.engine.model_host import ModelHost
from moed.daemon.engine.request import Emitted, GenerateJob, Generation
from moed.daemon.engine.sink import EventSink
from moed.daemon.engine.status import EngineStatus
from moed.daemon.model.loader import LoadProgress
from moed.daemon.telemetry.delta import cache_state, request_counters
from moed.protocol import (
    Channel,
    DoneEvent,
    EngineEvent,
    ErrorCode,
    FailedEvent,
    FinishReason,
    PromptProgress,
    ProtocolError,
    TelemetryEvent,
    TokenEvent,
)
from moed.protocol.events import LoadProgress as LoadProgressEvent  # the loader's is a callback


class RequestEvents:
    """Sends each request's events; called on the engine thread only."""

    def __init__(self, sink: EventSink, status: EngineStatus, host: ModelHost):
        self.sink = sink
        self.status = status
        self.host = host  # the loaded model's counters, its routing, the pipeline ranks

    def reject(self, job: GenerateJob, code: ErrorCode, message: str) -> None:
        """End a request that never started with a typed error."""
        self.sink.emit(job.identity, job.request_id, FailedEvent.of(code, message))

    def refuse(self, job: GenerateJob, exc: ProtocolError) -> None:
        """End a request that never started with its refusal (and what that carries)."""
        self.sink.emit(job.identity, job.request_id, FailedEvent.refusal(exc))

    def to_client(self, job: GenerateJob) -> Callable[[EngineEvent], None]:
        """Events for `job`'s client sent from elsewhere (its router trace's chunks)."""
        return lambda event: self.sink.emit(job.identity, job.request_id, event)

    def load_progress(self, job: GenerateJob) -> LoadProgress:
        """A reload's steps, for the request that waits on it."""

        def progress(stage: str, done: float, total: float, unit: str) -> None:
            event = LoadProgressEvent(stage, done, total, unit)
            self.sink.emit(job.identity, job.request_id, event)

        return progress

    def prompt_progress(self, gen: Generation, done: int, total: int) -> None:
        self.sink.emit(gen.job.identity, gen.job.request_id, PromptProgress(done, total))

    def prompt_read(self, gen: Generation, done: int, total: int) -> None:
        """A prompt chunk read, for a request that asked for progress: counted over the whole
        context, since what the prefix cache held is read too."""
        if gen.job.request.progress:
            cached = gen.cached_tokens
            self.prompt_progress(gen, cached + done, cached + total)

    def token(self, gen: Generation, token: int, row_logprobs: mx.array) -> bool:
        """Send a token (and telemetry when due); True when a stop sequence ended the text."""
        out = gen.add_token(token, row_logprobs)
        self.segments(gen, [token], out)
        gen.index += 1
        gen.completion += 1
        self.status.token_produced(time.time())
        if out.stopped:  # the text ends before the stop; `done` follows at once
            return True
        if gen.completion % gen.telemetry_every == 0:
            event = TelemetryEvent(self.telemetry(gen))
            self.sink.emit(gen.job.identity, gen.job.request_id, event)
        return False

    def segments(self, gen: Generation, ids: list[int], out: Emitted) -> None:
        """One `token` event per channel segment, in order: the first carries the token's ids
        and logprobs, the last its finished tool calls (PROTOCOL.md, Reasoning)."""
        segments = out.segments or ((Channel.ANSWER, ""),)
        last = len(segments) - 1
        for i, (channel, text) in enumerate(segments):
            event = TokenEvent(
                gen.index,
                ids if i == 0 else [],
                text,
                out.logprobs if i == 0 else None,
                (out.tool_calls or None) if i == last else None,
                channel,
            )
            self.sink.emit(gen.job.identity, gen.job.request_id, event)

    def telemetry(self, gen: Generation, timings: dict[str, Any] | None = None) -> dict[str, Any]:
        self.host.refresh_ranks()
        data = {"tokens": gen.completion, **(timings or gen.timings())}
        snapshot = self.host.stream_snapshot()
        if snapshot is not None:
            self.status.update(streaming=snapshot)
            data["experts"] = request_counters(gen.stream_before, snapshot)  # this request's
            data["cache"] = cache_state(snapshot)  # the daemon-wide cache, named apart
        return data

    def failed(self, gen: Generation, code: ErrorCode, message: str) -> None:
        self.sink.emit(gen.job.identity, gen.job.request_id, FailedEvent.of(code, message))

    def done(self, gen: Generation, reason: FinishReason) -> None:
        """The stream's last event: usage, timings and telemetry (every rank's counters)."""
        self.host.refresh_ranks(force=True)  # a client that saw `done` sees every rank's counters
        usage = {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.completion,
            "cached_tokens": min(gen.cached_tokens, gen.prompt_tokens),
        }
        timings = gen.timings()
        loaded = self.host.loaded
        routing = loaded.routing if loaded is not None else None
        done = DoneEvent(
            reason,
            usage,
            timings,
            self.telemetry(gen, timings),
            stop_sequence=gen.stops.matched,
            # K-reduction: the client must know
            lossy=routing.describe() if routing is not None and routing.lossy else None,
            notice=gen.notice or None,
        )
        self.sink.emit(gen.job.identity, gen.job.request_id, done)
