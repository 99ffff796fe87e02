"""A device failure inside a step, met in place: an out-of-memory or a GPU timeout that MLX raised
at a sync point (ground/device_errors.py) costs the step, not the process.

The step's pending arrays go (the batch, the fence's outputs, reads in flight, the expert pools'
contents: everything the failed command buffer may have poisoned), MLX's buffer cache is cleared,
memory is shed in the kind's order (recovery_ledger.py), and every interrupted row joins a new
batch with the tokens it already sent as part of its context: recomputed, each stream continues
with exactly the tokens an uninterrupted run gives (sampling is keyed by position). The model is
not loaded again and the pid stays. While the rows catch up the state is `recovering` and new
requests wait. Whatever the ledger will not recover takes the restart path. Composed into EngineCore
(its `in_place`).
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import mlx.core as mx

from moed.daemon.config import ServeConfig
from moed.daemon.engine.batch import MIN_CHUNK
from moed.daemon.engine.recovery_ledger import (
    SHED_ORDER,
    Recovery,
    RecoveryLedger,
    RecoveryPolicy,
    Shed,
)
from moed.daemon.engine.request import Generation
from moed.daemon.engine.status import DaemonState
from moed.daemon.ground.crashlog import backoff_factor
from moed.daemon.ground.device_errors import DeviceFailure, classify
from moed.protocol import FinishReason

if TYPE_CHECKING:  # the engine core composes this (core.py imports this module)
    from moed.daemon.engine.core import EngineCore
    from moed.daemon.experts.streamer import ExpertStreamer

log = logging.getLogger("moed.engine")


class InPlaceRecovery:
    """Recover a failed step's rows without a restart: the ledger of recoveries in place (how
    they are met, published at once) and the state they keep; the engine core's state it reads
    and sets through `core`."""

    def __init__(self, core: EngineCore, serve: ServeConfig) -> None:
        self._core = core
        version = str(getattr(mx, "__version__", ""))  # the stubs leave it out
        policy = RecoveryPolicy.of(serve.recover_in_place, serve.recovery_window_s, version)
        self.recovery = RecoveryLedger(policy)
        self.chunk_limit: int | None = None  # the prompt chunk's ceiling a recovery set
        self._budget_steps = 0  # expert-budget back-offs taken in place
        # Rows read again that have not yet passed where they were.
        self.catching_up: set[int] = set()
        core.status.update(
            device_recovery=policy.describe(), recoveries=self.recovery.counts_wire()
        )

    @property
    def recovering(self) -> bool:
        return self.recovery.active is not None

    def device_failed(self, exc: BaseException, failure: DeviceFailure) -> None:
        """A step raised a device failure: recover in place if the ledger allows, else (or if
        recovering fails in turn) the restart path."""
        why = self.recovery.judge(failure)
        if (
            why is None
            and self._core.host.loaded is not None
            and self._core.host.loaded.pipeline is not None
        ):
            why = "a pipeline's other ranks are inside the failed step"  # the group restarts
        if why is None:
            try:
                self._recover(exc, failure)
                return
            except Exception as again:  # a failure while recovering: nothing in place is sure
                log.exception("the recovery in place from %s failed", failure.value)
                why = f"the recovery from {failure.value} failed ({again})"
                failure = classify(again) or failure
        self._core.failures.device_restart(exc, failure, why)

    def _recover(self, exc: BaseException, failure: DeviceFailure) -> None:
        loaded = self._core.host.loaded
        assert self._core.batch is not None and loaded is not None  # a step ran
        record = self.recovery.begin(failure, str(exc))
        log.error("%s inside a step (%s): recovering in place", failure.value, exc)
        self._core.status.update(
            state=DaemonState.RECOVERING,
            last_recovery=record.describe(),
            recoveries=self.recovery.counts_wire(),
        )
        rows = sorted(self._core._rows.values(), key=lambda gen: gen.uid or 0)  # their join order
        largest_chunk = self.chunk_limit or self._core.batch.largest_chunk
        # The step's pending arrays: everything the failed command buffer may have poisoned.
        self._core.prefix.drop_unsaved()
        self._core.batch.abandon()
        self._core.batch = None
        self._core._rows = {}
        streamer = loaded.streamer
        slots = self._shed_in_order(record, streamer, largest_chunk)
        if streamer is not None:
            before = streamer.budget_bytes
            streamer.start_over(slots)
            if slots is not None:
                record.shed[Shed.EXPERT_BUDGET.value] = {
                    "from_bytes": before,
                    "to_bytes": streamer.budget_bytes,
                    "slots_per_layer": slots,
                }
        gc.collect()
        _settle_device()
        mx.clear_cache()
        self._core.batch = self._core._new_batch()
        for gen in rows:
            self._rejoin(gen)
        record.rows = len(self._core._rows)
        self.catching_up = set(self._core._rows)
        log.warning(
            "recovered from %s in place: %d row(s) read again, shed %s",
            failure.value,
            record.rows,
            record.shed or "nothing",
        )
        self._core.status.update(
            last_recovery=record.describe(),
            prompt_chunk_limit=self.chunk_limit,
            streaming=self._core.host.stream_snapshot(),
        )
        self._report(record)
        if not self.catching_up:
            self._recovered()

    def _shed_in_order(
        self, record: Recovery, streamer: ExpertStreamer | None, largest_chunk: int
    ) -> int | None:
        """Walk the kind's shed order (recovery_ledger.SHED_ORDER); returns the expert slots per
        layer the cache starts over with (None: as many as now). The prompt chunk's ceiling
        halves from the largest chunk the batch could read (or the ceiling already set)."""
        for step in SHED_ORDER[record.kind]:
            if step is Shed.PREFIX_MEMORY:
                released = self._core.prefix.shed()
                if released:
                    record.shed[step.value] = {"released_bytes": released}
            elif step is Shed.EXPERT_BUDGET:
                slots = self._backed_off_slots(streamer)
                if slots is not None:
                    return slots
            elif step is Shed.PROMPT_CHUNK:
                halved = max(MIN_CHUNK, largest_chunk // 2)
                if halved < largest_chunk:
                    self.chunk_limit = halved
                    record.shed[step.value] = {"from_tokens": largest_chunk, "to_tokens": halved}
                    return None
        return None

    def _backed_off_slots(self, streamer: ExpertStreamer | None) -> int | None:
        """The expert cache's next back-off step (the restart path's arithmetic, from the slots
        this load planned), or None when there is nothing left to shed."""
        if streamer is None:
            return None
        planned = streamer.plan.slots_per_layer
        target = max(1, int(planned * backoff_factor(self._budget_steps + 1)))
        if target >= min(streamer.slots):
            return None
        self._budget_steps += 1
        return target

    def _rejoin(self, gen: Generation) -> None:
        """The row joins the new batch with what it sent as context (prefix cache hits too)."""
        assert self._core.batch is not None  # the new batch
        context, left, sampler, constraint = gen.rejoin()
        if left <= 0:  # it had sent its last token; only its ending was lost
            self._core._finish(gen, FinishReason.LENGTH)
            return
        hit, marks = self._core.prefix.lookup(context, gen.cache_scope)
        gen.uid = self._core.batch.insert(
            context, left, sampler, constraint, hit, marks, gen.cache_scope
        )
        self._core._rows[gen.uid] = gen

    def row_moved(self, uid: int) -> None:
        """A row of the recovery sent a token or ended: it is past where it was."""
        if uid in self.catching_up:
            self.catching_up.discard(uid)
            # Rows also end when the process fails (the restart path): that is no recovery.
            failing = self._core.status.get("state") is DaemonState.FAILED
            if not self.catching_up and self.recovering and not failing:
                self._recovered()

    def _recovered(self) -> None:
        record = self.recovery.finish()
        if record is None:
            return
        log.warning("recovery from %s done in %.3fs", record.kind.value, record.took_s or 0.0)
        self._core.status.update(state=DaemonState.READY, last_recovery=record.describe())
        self._report(record)

    def _report(self, record: Recovery) -> None:
        """As it begins and once it is done: to the watchdog (it counts an out-of-memory one as
        a shed it need not take) and, done, to the crash record (the next start's back-off);
        advisory."""
        if self._core.owner.on_recovery is None:
            return
        try:
            self._core.owner.on_recovery(record.describe())
        except Exception:
            log.exception("could not record the recovery")


def _settle_device() -> None:
    """Wait for the device to be idle; the failed command buffer's error may be raised once more
    here (Metal keeps it for the next synchronize), which is the failure being handled."""
    for _attempt in range(2):
        try:
            mx.synchronize()
            return
        except RuntimeError as exc:
            if classify(exc) is None:
                raise
            log.warning("the device failure again at a synchronize: %s", exc)
    mx.synchronize()
