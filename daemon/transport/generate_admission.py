"""Admission of a validated generate against the daemon's state: its refusals, then its
submission to the model's engine (the rules on the message alone: admission.py)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from moed.daemon.config import ServeConfig
from moed.daemon.engine.request import GenerateJob
from moed.daemon.ground import crashlog
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.transport.admission import DuplicateId
from moed.daemon.transport.model_set import ModelSet, ServedModel
from moed.daemon.transport.streams import StreamTable
from moed.protocol import ErrorCode, GenerateRequest, ProtocolError


class GenerateAdmission:
    """A validated generate to its model's engine, or the typed refusal: draining, the model
    failed or stalled, a duplicate id, too many in flight (in all or on the connection), a request
    in flight at too many crashes (poison)."""

    def __init__(
        self,
        serve: ServeConfig,
        boot_id: str,
        poison: Collection[str],
        streams: StreamTable,
        models: ModelSet,
    ) -> None:
        self._serve = serve
        self._boot_id = boot_id
        self._poison = poison
        self._streams = streams
        self._models = models

    def admit(
        self,
        identity: bytes,
        msg: dict[str, Any],
        request: GenerateRequest,
        model: ServedModel,
        draining: bool,
    ) -> None:
        """Submit `request` (`msg` its wire map) to `model`'s engine, or raise its refusal."""
        request_id = msg["id"]
        key = (identity, request_id)
        if draining:
            raise ProtocolError(
                ErrorCode.SHUTTING_DOWN, "the daemon is shutting down; retry after it restarts"
            )
        if model.engine.fatal is not None:
            if model.engine.exit_code == DaemonExit.OUT_OF_MEMORY:
                raise ProtocolError(
                    ErrorCode.OUT_OF_MEMORY,
                    f"the model ran out of memory and is restarting: {model.engine.fatal}",
                )
            raise ProtocolError(
                ErrorCode.INTERNAL, f"the model failed to load: {model.engine.fatal}"
            )
        if model.progress.stalled_at is not None:
            raise ProtocolError(ErrorCode.ENGINE_STALLED, model.progress.message())
        if key in self._streams:
            # Not terminal for the running stream: sent with `id: nil`, the id in `target`.
            raise DuplicateId(request_id)
        serve = self._serve
        if len(self._streams) >= serve.max_pending:
            raise ProtocolError(
                ErrorCode.OVERLOADED, f"{len(self._streams)} requests in flight; retry later"
            )
        if self._streams.of_client(identity) >= serve.max_pending_per_client:
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                f"this connection has {self._streams.of_client(identity)} requests in flight "
                f"(at most {serve.max_pending_per_client} per client); retry later",
            )
        fingerprint = crashlog.fingerprint(msg)
        if fingerprint in self._poison:
            raise ProtocolError(
                ErrorCode.POISON_REQUEST,
                f"this request was in flight at {crashlog.POISON_AFTER} crashes of the daemon; "
                "it is refused, not replayed",
            )
        idle_before = not model.streams
        self._models.admit(model, key)  # room made for it first (or refused: busy, too large)
        model.progress.work_admitted(idle_before)
        self._streams.add(key, fingerprint)
        # Written before the engine sees it, so that a crash in it is pinned on it.
        crashlog.write_inflight(serve.state_dir, self._boot_id, self._streams.fingerprints())
        model.engine.submit(GenerateJob(identity, request_id, request))
