"""The engine: one thread that owns the MLX model and steps every active generation in turn.

It never touches the client socket: requests arrive on a queue, events leave through an EventSink
(an inproc ZMQ PUSH the transport thread drains). The same engine runs in-process in tests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from moed.daemon.config import ServeConfig
from moed.daemon.engine.request import GenerateJob, Generation, RequestKey
from moed.daemon.engine.status import DaemonState, EngineStatus
from moed.daemon.exit_codes import DaemonExit
from moed.daemon.model.loader import LoadedModel, MemoryPlanRefused, describe_model, load_model
from moed.daemon.runtime.crashlog import CrashKind, is_out_of_memory
from moed.daemon.runtime.faults import Faults
from moed.daemon.telemetry.delta import counters_delta
from moed.daemon.telemetry.trace import finish_request_trace, start_request_trace
from moed.protocol import ErrorCode, FinishReason, ProtocolError, ShedLevel
from moed.protocol import messages as wire

log = logging.getLogger("moed.engine")


class EventSink(Protocol):
    def emit(self, identity: bytes, msg: dict, terminal: bool = False) -> None: ...


class Engine:
    """Owns the model; admits, steps, cancels and finishes generations on its own thread."""

    def __init__(
        self,
        serve: ServeConfig,
        model_path: Path,
        sink_factory: Callable[[], EventSink],
        status: EngineStatus,
    ):
        self.serve = serve
        self.model_path = model_path
        self.status = status
        self._sink_factory = sink_factory
        # Jobs and commands share one FIFO: a cancel always comes after the job it names.
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._active: OrderedDict[RequestKey, Generation] = OrderedDict()
        self.loaded: LoadedModel | None = None
        self.thread = threading.Thread(target=self._run, name="moed-engine", daemon=True)
        self.fatal: BaseException | None = None
        self.exit_code: int = DaemonExit.FAILED  # what the process exits with once `fatal` is set
        self.faults = Faults.parse(serve.debug_faults)  # off unless debug_faults says otherwise
        # Set by the server: record a crash durably before the in-flight requests are failed.
        self.on_crash: Callable[[CrashKind, str], None] | None = None

    # ---- called from other threads -------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: GenerateJob) -> None:
        self._inbox.put(job)
        self.status.add(queued_requests=1)

    def cancel(self, key: RequestKey) -> None:
        self._inbox.put(("cancel", key))

    def shed(self, level: ShedLevel) -> None:
        self._inbox.put(("shed", level))

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("stop", None))

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        self.sink = self._sink_factory()
        try:
            t0 = time.perf_counter()
            log.info(
                "loading %s (%s)",
                self.model_path,
                "resident"
                if self.serve.resident
                else f"streaming, budget {self.serve.cache_budget}",
            )
            self.loaded = load_model(self.serve, self.model_path)
            self.status.update(
                state=DaemonState.READY.value,
                model=describe_model(self.loaded),
                load_s=round(time.perf_counter() - t0, 3),
                streaming=self._stream_snapshot(),
                memory_plan=self.loaded.streamer.plan.describe() if self.loaded.streamer else None,
            )
            log.info("model loaded from %s in %.2fs", self.model_path, time.perf_counter() - t0)
        except BaseException as exc:  # a model that cannot load is fatal for the daemon
            log.exception("model load failed")
            self._record_crash(CrashKind.LOAD_FAILED, f"{exc.__class__.__name__}: {exc}")
            if isinstance(exc, MemoryPlanRefused):
                self.exit_code = DaemonExit.DOES_NOT_FIT
            self.fatal = exc
            self.status.update(
                state=DaemonState.FAILED.value, error=f"{exc.__class__.__name__}: {exc}"
            )
            self._fail_queued(ErrorCode.INTERNAL, f"model failed to load: {exc}")
            return
        try:
            while not self._stop.is_set() and self.fatal is None:
                self._drain_inbox(block=not self._active)
                for key in list(self._active):
                    if key in self._active:
                        self._step(key)
            if self.fatal is None:
                self._finish_all(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        except (
            Exception
        ) as exc:  # a bug outside a step: fail everyone and exit, never hang silently
            self._engine_failed(exc)
        self._close_streamer()

    def _engine_failed(self, exc: Exception) -> None:
        log.exception("the engine failed")
        self._record_crash(CrashKind.ENGINE_FAILED, f"{exc.__class__.__name__}: {exc}")
        self.status.update(state=DaemonState.FAILED.value, error=f"{exc.__class__.__name__}: {exc}")
        message = f"the engine failed ({exc.__class__.__name__}); the daemon restarts"
        for gen in list(self._active.values()):
            try:
                self._finish(gen, ErrorCode.INTERNAL, message)
            except Exception:
                self._active.pop(gen.job.key, None)
        self._fail_queued(ErrorCode.INTERNAL, message)
        self.exit_code = DaemonExit.FAILED
        self.fatal = exc  # last: the transport flushes the errors, then exits non-zero

    def _close_streamer(self) -> None:
        streamer = self.loaded.streamer if self.loaded else None
        if streamer is None:
            return
        try:
            streamer.save_profile()
        except OSError:
            log.exception("could not save the expert-usage profile")
        streamer.close()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: Any) -> None:
        if isinstance(item, GenerateJob):
            self.status.add(queued_requests=-1)
            self._admit(item)
            return
        command, arg = item
        if command == "cancel":
            if (gen := self._active.get(arg)) is not None:  # else it already ended: nothing to do
                self._finish(gen, FinishReason.CANCELLED)
        elif command == "shed":
            self._shed(arg)

    def _admit(self, job: GenerateJob) -> None:
        try:
            gen = Generation(
                job,
                self.loaded,
                self.serve,
                self._stream_snapshot(),
                on_progress=lambda: self.status.update(last_progress_at=time.time()),
            )
            gen.trace = start_request_trace(
                self.loaded,
                job,
                self.serve,
                lambda m, i=job.identity: self.sink.emit(i, m),
                gen.prompt_tokens,
            )
            self._active[job.key] = gen
            self.status.update(busy=True, active_requests=len(self._active))
        except ProtocolError as exc:
            self._emit_error(job, exc.code, exc.message)
        except Exception as exc:
            if is_out_of_memory(exc):  # the prefill ran out of memory
                self._out_of_memory(exc, also=job)
                return
            log.exception("request %r could not start", job.request.get("id"))
            self._emit_error(job, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")

    def _step(self, key: RequestKey) -> None:
        gen = self._active[key]
        try:
            if self.faults:
                self.faults.before_step(self.status.get("tokens_generated") or 0)
            token, finish = gen.step()
        except Exception as exc:
            if is_out_of_memory(exc):
                self._out_of_memory(exc)
                return
            log.exception("generation %r failed", gen.job.request.get("id"))
            self._finish(gen, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")
            return
        if finish is not None:
            self._finish(gen, finish)
            return
        gen.detokenizer.add_token(token)
        text = gen.detokenizer.last_segment
        self.sink.emit(
            gen.job.identity, wire.token(gen.job.request["id"], gen.index, [token], text)
        )
        gen.index += 1
        gen.completion += 1
        self.status.token_produced(time.time())
        if gen.completion % gen.telemetry_every == 0:
            self.sink.emit(
                gen.job.identity, wire.telemetry(gen.job.request["id"], self._telemetry(gen))
            )

    def _telemetry(self, gen: Generation, timings: dict | None = None) -> dict:
        data = {"tokens": gen.completion, **(timings or gen.timings())}
        snapshot = self._stream_snapshot()
        if snapshot is not None:
            self.status.update(streaming=snapshot)
            data["experts"] = counters_delta(gen.stream_before, snapshot)
        return data

    def _out_of_memory(self, exc: BaseException, also: GenerateJob | None = None) -> None:
        """A Metal command-buffer failure: record it, fail every request, and let the process exit
        non-zero so that launchd restarts it (with a smaller cache budget)."""
        log.critical("out of memory: %s", exc)
        self._record_crash(CrashKind.OUT_OF_MEMORY, f"{exc.__class__.__name__}: {exc}")
        message = f"the daemon ran out of memory ({exc}); it restarts with a smaller expert cache"
        self.status.update(state=DaemonState.FAILED.value, error=f"out of memory: {exc}")
        if also is not None:
            self._emit_error(also, ErrorCode.OUT_OF_MEMORY, message)
        for gen in list(self._active.values()):
            self._finish(gen, ErrorCode.OUT_OF_MEMORY, message)
        self._fail_queued(ErrorCode.OUT_OF_MEMORY, message)
        self.exit_code = DaemonExit.OUT_OF_MEMORY
        self.fatal = exc  # last: the transport exits once it sees this, after flushing the errors

    def _record_crash(self, kind: CrashKind, message: str) -> None:
        if self.on_crash is None:
            return
        try:
            self.on_crash(kind, message)
        except Exception:  # the record is advisory; failing the requests is not
            log.exception("could not record the crash")

    def _finish(
        self,
        gen: Generation,
        reason: FinishReason | ErrorCode,
        message: str = "the daemon is shutting down",
    ) -> None:
        self._active.pop(gen.job.key, None)
        # Published before the terminal message, so a client that saw `done` sees the count drop.
        self.status.update(active_requests=len(self._active), busy=bool(self._active))
        req_id = gen.job.request["id"]
        finish_request_trace(gen.trace)  # its last chunk goes out before the terminal message
        if isinstance(reason, ErrorCode):
            self.status.add(requests_failed=1)
            self.sink.emit(gen.job.identity, wire.error(req_id, reason, message), terminal=True)
            return
        gen.detokenizer.finalize()
        tail = gen.detokenizer.last_segment
        if tail:
            self.sink.emit(gen.job.identity, wire.token(req_id, gen.index, [], tail))
        self.status.add(requests_served=1)
        usage = {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion}
        timings = gen.timings()
        msg = wire.done(req_id, reason, usage, timings, telemetry=self._telemetry(gen, timings))
        self.sink.emit(gen.job.identity, msg, terminal=True)

    def _finish_all(self, code: ErrorCode, message: str) -> None:
        for gen in list(self._active.values()):
            self._finish(gen, code, message)
        self._fail_queued(code, message)

    def _fail_queued(self, code: ErrorCode, message: str) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, GenerateJob):
                self.status.add(queued_requests=-1)
                self._emit_error(item, code, message)

    def _shed(self, level: ShedLevel) -> None:
        import mlx.core as mx

        released = 0
        if self.loaded is not None and self.loaded.streamer is not None:
            released = self.loaded.streamer.shed(0.5)
        mx.clear_cache()
        log.warning("shed level=%s released=%d bytes", level.value, released)
        cancelled = None
        if level is ShedLevel.CANCEL_NEWEST and self._active:
            newest = next(reversed(self._active.values()))
            cancelled = newest.job.request["id"]
            self._finish(
                newest,
                ErrorCode.OUT_OF_MEMORY,
                "cancelled to relieve memory pressure (the newest request is shed first)",
            )
        self.status.add(sheds=1)
        self.status.update(
            last_shed={
                "level": level.value,
                "at": time.time(),
                "released_bytes": released,
                "cancelled": cancelled,
            }
        )

    def _emit_error(self, job: GenerateJob, code: ErrorCode, message: str) -> None:
        self.sink.emit(job.identity, wire.error(job.request["id"], code, message), terminal=True)

    def _stream_snapshot(self) -> dict | None:
        if self.loaded is None or self.loaded.streamer is None:
            return None
        return self.loaded.streamer.snapshot()
