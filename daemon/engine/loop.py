"""The engine core on its own thread behind an inbox: the interface the transport uses.

The transport (or a test) calls submit/cancel/shed/stop from any thread; each becomes a typed
command on one FIFO that the engine thread hands to the EngineCore between rounds of work.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moed.daemon.config import ServeConfig
from moed.daemon.engine.commands import (
    AwaitRoom,
    Cancel,
    ClearPrefixCache,
    EngineCommand,
    Load,
    OwnerHooks,
    Shed,
    Stop,
    Submit,
    Unload,
)
from moed.daemon.engine.core import EngineCore
from moed.daemon.engine.overcommit import check_overcommit_possible, overcommit_device
from moed.daemon.engine.recovery_ledger import RecoveryPhase
from moed.daemon.engine.request import GenerateJob, RequestKey
from moed.daemon.engine.sink import EventSink
from moed.daemon.engine.status import DaemonState, EngineStatus
from moed.daemon.engine.step_abort import CancelBoard
from moed.daemon.ground.crashlog import CrashKind, record_recovery
from moed.daemon.ground.device_errors import DeviceFailure
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.ground.faults import Faults
from moed.daemon.ground.watchdog_state import report_recovery
from moed.daemon.model.loader import LoadedModel
from moed.protocol import ErrorCode, ShedLevel

log = logging.getLogger("moed.engine")


class Engine:
    """Runs an EngineCore on the `moed-engine` thread; the sink is created on that thread."""

    def __init__(
        self,
        serve: ServeConfig,
        model_path: Path,
        sink_factory: Callable[[], EventSink],
        status: EngineStatus,
        lazy: bool = False,
    ):
        self.serve = serve
        self.lazy = lazy  # load on the first request or `Load`, not at the thread's start
        self.model_path = model_path
        self.status = status
        self._sink_factory = sink_factory
        self._inbox: queue.Queue[EngineCommand] = queue.Queue()
        self._stop = threading.Event()
        self.cancels = CancelBoard()  # seen inside a step: a prompt step of cancelled rows stops
        self.core: EngineCore | None = None
        # Checked here, on the caller's thread, so a bad setting fails the start as a config error.
        self.faults = Faults.parse(serve.debug_faults)
        if self.faults.overcommits:  # a real allocation over the GPU's memory
            check_overcommit_possible()
            self.faults.allocate_with(overcommit_device)
        for name in ("max_batch", "prefill_chunk"):
            if getattr(serve, name) < 1:
                raise ValueError(f"{name} = {getattr(serve, name)!r}: must be an integer >= 1")
        if not 0 <= serve.batch_window_ms <= 60_000:
            raise ValueError(f"batch_window_ms = {serve.batch_window_ms!r}: must be 0 to 60000")
        self.thread = threading.Thread(target=self._run, name="moed-engine", daemon=True)
        # Set by the server: record a crash durably before the in-flight requests are failed.
        self.on_crash: Callable[[CrashKind, str], None] | None = None

    @property
    def loaded(self) -> LoadedModel | None:
        return self.core.loaded if self.core else None

    @property
    def fatal(self) -> BaseException | None:
        return self.core.fatal if self.core else None

    @property
    def exit_code(self) -> int:
        return self.core.exit_code if self.core else DaemonExit.FAILED

    # ---- called from other threads -------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: GenerateJob) -> None:
        self.status.add(queued_requests=1)
        self._inbox.put(Submit(job))

    def cancel(self, key: RequestKey) -> None:
        self.cancels.post(key)
        self._inbox.put(Cancel(key))

    def shed(self, level: ShedLevel) -> None:
        self._inbox.put(Shed(level))

    def clear_prefix_cache(self) -> None:
        self._inbox.put(ClearPrefixCache())

    def load(self) -> None:
        self._inbox.put(Load())

    def unload(self) -> Unload:
        command = Unload()
        self._inbox.put(command)
        return command

    def await_room(self, released: tuple[threading.Event, ...]) -> None:
        self._inbox.put(AwaitRoom(released))

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(Stop())

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        core = EngineCore(
            self.serve,
            self.model_path,
            self._sink_factory(),
            self.status,
            owner=OwnerHooks(
                self.on_crash, self._reject_queued, self._record_recovery, self._inbox.put
            ),
            faults=self.faults,
            cancels=self.cancels,
        )
        self.core = core
        if self.lazy:
            self.status.update(state=DaemonState.IDLE)
        elif not core.load():
            return
        try:
            while not self._stop.is_set() and core.fatal is None:
                self._drain_inbox(core, core.idle_for())
                if core.fatal is None:
                    core.step()
                    core.maybe_unload()
            if core.fatal is None:
                message = "the daemon is shutting down"
                core.finish_all(ErrorCode.SHUTTING_DOWN, message)
                self._reject_queued(ErrorCode.SHUTTING_DOWN, message)
        except Exception as exc:  # a bug outside a step: fail everyone and exit, never hang
            core.failures.engine_failed(exc)
        core.close()

    def _record_recovery(self, recovery: dict[str, Any]) -> None:
        """A recovery in place, as it begins and once done: the watchdog hears of it at once
        (ground/watchdog_state.py); a done out-of-memory one joins the crash record's history
        (the next start's back-off; one that failed half-way is recorded as the crash)."""
        state_dir, boot_id = self.serve.state_dir, self.status.get("boot_id")
        done = recovery.get("phase") == RecoveryPhase.RECOVERED.value
        if done and recovery.get("kind") == DeviceFailure.OUT_OF_MEMORY.value:
            record_recovery(state_dir, recovery, boot_id)
        report_recovery(state_dir, {**recovery, "boot_id": boot_id, "pid": self.status.get("pid")})

    def _drain_inbox(self, core: EngineCore, wait_s: float | None) -> None:
        """Hand every queued command to the core, first waiting up to `wait_s` for one (None: a
        short poll, so that the stop flag is seen)."""
        try:
            if wait_s == 0:
                command = self._inbox.get_nowait()
            else:
                command = self._inbox.get(timeout=0.05 if wait_s is None else min(wait_s, 0.05))
        except queue.Empty:
            return
        while True:
            if isinstance(command, Submit):
                self.status.add(queued_requests=-1)
            if isinstance(command, (Load, Unload, AwaitRoom)):
                self._lifecycle(core, command)
            else:
                core.handle(command)
            if core.fatal is not None:
                return
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _lifecycle(self, core: EngineCore, command: Load | Unload | AwaitRoom) -> None:
        """Model residency asked from outside (engine/core.py keeps the request path)."""
        if isinstance(command, AwaitRoom):
            for released in command.released:
                if not released.wait(command.timeout_s):
                    log.warning("a model did not unload within %ss", command.timeout_s)
        elif isinstance(command, Load):
            if core.loaded is None:
                core.status.update(busy=True)  # the watchdog watches a load
                core.load()
                core.status.update(busy=core.has_work)
        elif core.loaded is not None and not core.has_work:
            core.unload()
            command.done.set()
        else:  # busy (or not loaded): unload as soon as it is idle
            core.host.unload_when_idle()
            command.done.set()

    def _reject_queued(self, code: ErrorCode, message: str) -> None:
        """Fail every request still in the inbox (the engine is failing or draining)."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Submit):
                self.status.add(queued_requests=-1)
                if self.core is not None:
                    self.core.events.reject(command.job, code, message)
