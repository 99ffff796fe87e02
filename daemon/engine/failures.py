"""How the engine fails: a step's rows, or the whole process (a crash record, every request failed
with a typed error, `fatal` published for the transport to exit with the kind's code), a model
that cannot load, and a step stopped because every row in it was cancelled. Composed into
EngineCore (its `failures`), to keep one concern per module."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from moed.daemon.distributed.failure import is_group_failure
from moed.daemon.engine.model_host import ModelLoadFailed
from moed.daemon.engine.request import Generation
from moed.daemon.engine.status import DaemonState
from moed.daemon.engine.step_abort import StepAborted
from moed.daemon.engine.text_path import failure_of
from moed.daemon.ground.crashlog import CrashKind
from moed.daemon.ground.device_errors import DeviceFailure, classify
from moed.daemon.ground.exit_codes import DaemonExit
from moed.protocol import ErrorCode, FinishReason

if TYPE_CHECKING:  # the engine core composes this (core.py imports this module)
    from moed.daemon.engine.core import EngineCore

log = logging.getLogger("moed.engine")

_EXIT_FOR = {
    CrashKind.ENGINE_FAILED: DaemonExit.FAILED,
    CrashKind.OUT_OF_MEMORY: DaemonExit.OUT_OF_MEMORY,
    CrashKind.RANK_FAILED: DaemonExit.RANK_FAILED,
}


class EngineFailures:
    """The failure paths of an EngineCore (whose state they read and set)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def engine_failed(self, exc: Exception) -> None:
        """A bug outside a step: fail everyone and let the daemon exit, never hang silently."""
        log.exception("the engine failed")
        what = f"{exc.__class__.__name__}: {exc}"
        message = f"the engine failed ({exc.__class__.__name__}); the daemon restarts"
        self._fail_process(exc, CrashKind.ENGINE_FAILED, what, ErrorCode.INTERNAL, message)

    def load_failed(self, failed: ModelLoadFailed | RuntimeError) -> None:
        """The model cannot load: fatal for the daemon, with the load's exit code; the requests
        waiting in the inbox fail. A RuntimeError: a pipeline rank failed while loading (the
        group monitor says which)."""
        if not isinstance(failed, ModelLoadFailed):
            self._group_failed(failed)
            return
        exc = failed.cause
        self._record_crash(CrashKind.LOAD_FAILED, str(failed))
        self._core.exit_code = failed.exit_code
        self._core.status.update(state=DaemonState.FAILED, error=str(failed))
        self._core.owner.reject_queued(ErrorCode.INTERNAL, f"model failed to load: {exc}")
        self._core.fatal = exc

    def step_failed(self, exc: Exception) -> None:
        """A step raised: stopped at a layer, its rows all cancelled (step_abort.py); a device
        failure is met in place (or restarts the process), a pipeline's step fails the group,
        anything else fails the batch's rows."""
        if isinstance(exc, StepAborted):
            self._abandon_step()
            return
        failure = classify(exc)  # a device failure: out of memory, a GPU timeout, other
        if failure is not None:
            self._core.in_place.device_failed(exc, failure)
            return
        assert self._core.host.loaded is not None  # a batch runs on a loaded model
        if self._core.host.loaded.pipeline is not None:
            # Any failed step, not only a lost peer: the other ranks may still be inside this
            # step's collectives, so no new batch can start in step with them.
            self._group_failed(exc)
            return
        self._batch_failed(exc)

    def row_failed(self, gen: Generation, exc: BaseException) -> None:
        """One request's text path failed (text_path.py): it ends with a typed error, and the
        batch's other rows and the daemon carry on."""
        code, message = failure_of(exc)
        log.warning("request %r failed alone: %s", gen.job.request_id, exc, exc_info=exc)
        self._core._finish(gen, code, message)

    def _batch_failed(self, exc: Exception) -> None:
        """A step raised: the batch state is unknown, so every row fails and a new batch starts."""
        log.exception("a batch step failed")
        message = f"{exc.__class__.__name__}: {exc}"
        for gen in list(self._core._rows.values()):
            self._core._finish(gen, ErrorCode.INTERNAL, message)
        assert self._core.batch is not None  # only a running batch fails a step
        self._core.prefix.drop_unsaved()  # caches of a batch whose state is unknown
        self._core.batch.close()
        self._core.batch = self._core._new_batch()

    def only_cancelled_rows(self) -> bool:
        """Whether the running prompt step may stop at this layer: every row of the batch was
        cancelled (a pipeline's other ranks are inside the same step: never there)."""
        if not self._core.cancels or not self._core._rows:
            return False
        if self._core.host.loaded is None or self._core.host.loaded.pipeline is not None:
            return False
        return self._core.cancels.holds_all(gen.job.key for gen in self._core._rows.values())

    def _abandon_step(self) -> None:
        """The step stopped at a layer (step_abort.py): its half-written batch held only
        cancelled rows, so it goes whole and they end cancelled."""
        log.info(
            "a prompt step stopped at a layer: its %d row(s) were cancelled", len(self._core._rows)
        )
        assert self._core.batch is not None  # only a running batch steps
        self._core.batch.close()
        self._core.batch = self._core._new_batch()
        for gen in list(self._core._rows.values()):
            self._core._finish(gen, FinishReason.CANCELLED)

    def device_restart(self, exc: BaseException, failure: DeviceFailure, why: str) -> None:
        """A device failure not recovered in place (`why`): the process exits non-zero so that
        the service manager restarts it, with a smaller cache budget."""
        log.critical("%s, not recovered in place (%s): %s", failure.value, why, exc)
        if failure is DeviceFailure.OUT_OF_MEMORY:
            message = (
                f"the daemon ran out of memory ({exc}); it restarts with a smaller expert cache"
            )
        else:
            message = f"the device failed ({failure.value}: {exc}); the daemon restarts"
        what = f"{exc.__class__.__name__}: {exc} ({failure.value}; {why})"
        self._fail_process(exc, CrashKind.OUT_OF_MEMORY, what, ErrorCode.OUT_OF_MEMORY, message)

    def _group_failed(self, exc: BaseException) -> None:
        """A collective lost its peer (or a step failed mid-collective): every request fails
        retryably and the group restarts."""
        what = "a pipeline rank failed" if is_group_failure(exc) else "a pipeline step failed"
        message = f"{what} ({exc}); the daemon restarts the group"
        log.error("%s", message)
        self._fail_process(exc, CrashKind.RANK_FAILED, message, ErrorCode.RANK_FAILED, message)

    def _fail_process(
        self, exc: BaseException, kind: CrashKind, what: str, code: ErrorCode, message: str
    ) -> None:
        """Say `failed` (at once: /health answers 503 from here on), record the crash, fail every
        request with `code`, and publish `fatal` (last: the transport flushes the errors, then
        exits with the kind's code)."""
        self._core.status.update(state=DaemonState.FAILED, error=what)
        self._record_crash(kind, what)
        for gen in list(self._core._gens.values()):
            try:
                self._core._finish(gen, code, message)
            except Exception:  # a generation broken by the failure still must leave
                self._core._forget(gen.job.key)
        self._core.owner.reject_queued(code, message)
        self._core.exit_code = _EXIT_FOR[kind]
        self._core.fatal = exc

    def _record_crash(self, kind: CrashKind, message: str) -> None:
        if self._core.owner.on_crash is None:
            return
        try:
            self._core.owner.on_crash(kind, message)
        except Exception:  # the record is advisory; failing the requests is not
            log.exception("could not record the crash")
