"""A submitted request becomes a generation on the loaded model (with its router trace when one
is asked for), or ends at once: refused with its own error (a prompt or a schema the model cannot
take) or, for anything else, rejected as internal while the daemon serves everyone else."""

from __future__ import annotations

import logging

from moed.daemon.config import ServeConfig
from moed.daemon.engine.model_host import ModelHost
from moed.daemon.engine.request import GenerateJob, Generation
from moed.daemon.engine.request_events import RequestEvents
from moed.daemon.ground.faults import Faults
from moed.daemon.telemetry.request_trace import start_request_trace
from moed.protocol import ErrorCode, ProtocolError

log = logging.getLogger("moed.engine")


def start_generation(
    job: GenerateJob, host: ModelHost, serve: ServeConfig, faults: Faults, events: RequestEvents
) -> Generation | None:
    """The generation of `job`, or None once its client was sent why it cannot start."""
    loaded = host.loaded
    assert loaded is not None  # admitted on a loaded model
    try:
        gen = Generation(job, loaded, serve, host.stream_snapshot(), faults)
        gen.trace = start_request_trace(
            loaded,
            job.request_id,
            job.request.trace,
            serve.trace_dir,
            events.to_client(job),
            gen.prompt_tokens,
        )
    except ProtocolError as exc:
        events.refuse(job, exc)
        return None
    except Exception as exc:
        log.exception("request %r could not start", job.request_id)
        events.reject(job, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")
        return None
    return gen
