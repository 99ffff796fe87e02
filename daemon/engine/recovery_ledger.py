"""When a device failure inside a step is recovered in place, and what a recovery sheds, in which
order. Pure: failures and times in, verdicts and records out (engine/recovery.py acts on them).

In place once per kind within the window; a second failure of the same kind within it, any failure
while a recovery is under way, or a device error that is neither memory nor a timeout takes the
restart path (crash record, exit 5, a smaller budget at the next start). So does every failure
under an MLX that cannot raise a failed Metal command buffer where it can be caught
(ground/device_errors.py), or with `recover_in_place = false`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moed.daemon.ground.device_errors import (
    FIRST_MLX_CATCHING_METAL_FAILURES,
    DeviceFailure,
    catches_device_failures,
)


class Shed(str, enum.Enum):
    """What a recovery gives up, in the order of its kind (SHED_ORDER)."""

    PREFIX_MEMORY = "prefix_cache_memory"  # the prefix cache's memory tier: no request loses it
    EXPERT_BUDGET = "expert_budget"  # the expert cache, by the restart path's back-off step
    PROMPT_CHUNK = "prompt_chunk"  # the prompt chunk's ceiling, halved: a smaller command buffer


# The memory tier is always emptied when it holds anything; the first of the others that can
# still shrink does, and the walk stops there. A timeout is a command buffer that ran too long:
# a smaller chunk comes before anything else.
SHED_ORDER: dict[DeviceFailure, tuple[Shed, ...]] = {
    DeviceFailure.OUT_OF_MEMORY: (Shed.PREFIX_MEMORY, Shed.EXPERT_BUDGET, Shed.PROMPT_CHUNK),
    DeviceFailure.GPU_TIMEOUT: (Shed.PROMPT_CHUNK, Shed.PREFIX_MEMORY, Shed.EXPERT_BUDGET),
}
RECOVERABLE = frozenset(SHED_ORDER)


class RecoveryPhase(str, enum.Enum):
    RECOVERING = "recovering"  # the interrupted rows are read again
    RECOVERED = "recovered"  # every one of them is past where it was


@dataclass(frozen=True)
class RecoveryPolicy:
    in_place: bool
    window_s: float
    why_not: str  # the restart path's reason when not in place

    @classmethod
    def of(cls, enabled: bool, window_s: float, mlx_version: str) -> RecoveryPolicy:
        if not enabled:
            return cls(False, window_s, "recover_in_place is off")
        if not catches_device_failures(mlx_version):
            first = ".".join(map(str, FIRST_MLX_CATCHING_METAL_FAILURES))
            why = (
                f"MLX {mlx_version} predates ml-explore/mlx#3523 (MLX {first}): a failed Metal "
                "command buffer aborts the process"
            )
            return cls(False, window_s, why)
        return cls(True, window_s, "")

    def describe(self) -> str:
        return "in_place" if self.in_place else f"restart: {self.why_not}"


@dataclass
class Recovery:
    """One recovery in place: what failed, what it shed, how long the rows took to catch up."""

    kind: DeviceFailure
    message: str
    at: float  # unix seconds
    rows: int = 0  # interrupted rows read again
    phase: RecoveryPhase = RecoveryPhase.RECOVERING
    shed: dict[str, Any] = field(default_factory=dict)  # Shed value -> what it gave up
    took_s: float | None = None  # from the failure until every row caught up

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "message": self.message[:500],
            "at": self.at,
            "rows": self.rows,
            "phase": self.phase.value,
            "shed": dict(self.shed),
            "took_s": self.took_s,
        }


class RecoveryLedger:
    """Recoveries so far: whether the next failure may be recovered in place, counts by kind."""

    def __init__(self, policy: RecoveryPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._last_at: dict[DeviceFailure, float] = {}
        self._started: float | None = None
        self.counts: dict[DeviceFailure, int] = {kind: 0 for kind in SHED_ORDER}
        self.active: Recovery | None = None  # under way
        self.last: Recovery | None = None

    def judge(self, failure: DeviceFailure) -> str | None:
        """None: recover in place; else why the restart path is taken."""
        if not self.policy.in_place:
            return self.policy.why_not
        if failure not in RECOVERABLE:
            return "a device error that is neither out of memory nor a GPU timeout"
        if self.active is not None:
            return f"a failure while recovering from {self.active.kind.value}"
        last = self._last_at.get(failure)
        window = self.policy.window_s
        if last is not None and self._clock() - last < window:
            return f"a second {failure.value} within {window:g} s"
        return None

    def begin(self, failure: DeviceFailure, message: str) -> Recovery:
        self._last_at[failure] = self._started = self._clock()
        self.counts[failure] += 1
        self.active = self.last = Recovery(failure, message, time.time())
        return self.active

    def finish(self) -> Recovery | None:
        """Every interrupted row caught up: the recovery is over."""
        done, self.active = self.active, None
        if done is not None and self._started is not None:
            done.phase = RecoveryPhase.RECOVERED
            done.took_s = round(self._clock() - self._started, 3)
        return done

    def oom_recoveries(self) -> int:
        return self.counts[DeviceFailure.OUT_OF_MEMORY]

    def counts_wire(self) -> dict[str, int]:
        return {kind.value: n for kind, n in self.counts.items()}
