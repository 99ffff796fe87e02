"""A trace per request: to the client as `trace` messages (`trace: true`) and/or to a file per
request under `trace_dir`; the engine starts one when a request joins and finishes it at its end."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moed.daemon.model.loader import describe_model
from moed.daemon.telemetry.trace import SUFFIX, TraceRecorder, trace_header
from moed.daemon.telemetry.trace_file import open_trace_file
from moed.protocol import messages as wire

log = logging.getLogger("moed.telemetry.trace")


def _safe(name: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name))[:64] or "request"


def start_request_trace(
    loaded: Any,
    job: Any,
    serve: Any,
    emit: Callable[[dict], None],
    prompt_tokens: int | None = None,
) -> TraceRecorder | None:
    """A recorder for this request when it asked for a trace (`trace: true`: chunks go back to the
    client as `trace` messages) or the daemon traces everything (`trace_dir`: a file per request).
    None otherwise, or when the model is resident (no streaming, nothing to observe)."""
    req = job.request
    to_client = bool(req.get("trace"))
    trace_dir = getattr(serve, "trace_dir", "") or ""
    if not (to_client or trace_dir):
        return None
    streamer = getattr(loaded, "streamer", None)
    if streamer is None:
        log.info(
            "request %r asked for a trace, but the model is resident: nothing to trace",
            req.get("id"),
        )
        return None
    sinks: list[Callable[[bytes], None]] = []
    if to_client:
        seq = iter(range(1 << 62))
        sinks.append(lambda data: emit(wire.trace_chunk(req["id"], next(seq), data)))
    file_sink = None
    if trace_dir:
        name = f"{time.strftime('%Y%m%d-%H%M%S')}-{_safe(req.get('id'))}{SUFFIX}"
        file_sink = open_trace_file(
            Path(trace_dir).expanduser() / name,
            lambda message: emit(wire.telemetry(req["id"], {"warning": message})),
        )
    if file_sink is not None:
        sinks.append(file_sink.write)
    if not sinks:
        return None
    header = trace_header(
        streamer, describe_model(loaded), {"id": str(req.get("id")), "prompt_tokens": prompt_tokens}
    )
    recorder = TraceRecorder(streamer, header, lambda data: [s(data) for s in sinks])
    recorder.file = file_sink  # closed by finish_request_trace
    return recorder


def finish_request_trace(recorder: TraceRecorder | None) -> None:
    if recorder is None:
        return
    try:
        recorder.close()
    finally:
        f = getattr(recorder, "file", None)
        if f is not None:
            f.close()
