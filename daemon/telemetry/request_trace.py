"""A trace per request: to the client as `trace` messages (`trace: true`) and/or to a file per
request under `trace_dir`; the engine starts one when a request joins and finishes it at its end."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moed.daemon.model.loader import LoadedModel, describe_model
from moed.daemon.telemetry.trace import SUFFIX, TraceRecorder, trace_header
from moed.daemon.telemetry.trace_file import open_trace_file
from moed.protocol import EngineEvent, TelemetryEvent, TraceEvent
from moed.protocol.generate import RequestId

log = logging.getLogger("moed.telemetry.trace")


def _safe(name: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name))[:64] or "request"


def start_request_trace(
    loaded: LoadedModel,
    request_id: RequestId,
    to_client: bool,
    trace_dir: str,
    emit: Callable[[EngineEvent], None],
    prompt_tokens: int | None = None,
) -> TraceRecorder | None:
    """A recorder for this request when it asked for a trace (`to_client`, the request's `trace`:
    chunks go back to the client as `trace` messages) or the daemon traces everything
    (`trace_dir`: a file per request). None otherwise, or when the model is resident (no
    streaming, nothing to observe)."""
    if not (to_client or trace_dir):
        return None
    streamer = loaded.streamer
    if streamer is None:
        log.info(
            "request %r asked for a trace, but the model is resident: nothing to trace",
            request_id,
        )
        return None
    sinks: list[Callable[[bytes], None]] = []
    if to_client:
        seq = iter(range(1 << 62))
        sinks.append(lambda data: emit(TraceEvent(next(seq), data)))
    file_sink = None
    if trace_dir:
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{_safe(request_id)}{SUFFIX}"
        file_sink = open_trace_file(
            Path(trace_dir).expanduser() / name,
            lambda message: emit(TelemetryEvent({"warning": message})),
        )
    if file_sink is not None:
        sinks.append(file_sink.write)
    if not sinks:
        return None
    header = trace_header(
        streamer,
        describe_model(loaded),
        {"id": str(request_id), "prompt_tokens": prompt_tokens},
    )

    def write(data: bytes) -> None:
        for sink in sinks:
            sink(data)

    return TraceRecorder(streamer, header, write, file=file_sink)


def finish_request_trace(recorder: TraceRecorder | None) -> None:
    if recorder is None:
        return
    try:
        recorder.close()
    finally:
        if recorder.file is not None:
            recorder.file.close()
