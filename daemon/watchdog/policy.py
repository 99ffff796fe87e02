"""The escalation state machine. Pure: samples in, decisions out; no clocks, no I/O.

Two rules share one ladder:
- memory: swap grew by `swap_growth_bytes` over its baseline, or the kernel reports critical
  pressure, for `consecutive` samples in a row -> take the next step. The baseline is re-taken
  after every step (the next step needs fresh growth: swap that stopped growing after a shed is
  the shed working, and macOS keeps swapped pages out long after the pressure is gone), when swap
  shrinks, and when a new daemon starts.
- progress: the daemon is busy and has produced no token for `progress_timeout_s` (or has not
  answered at all for that long while its process lives) -> it is wedged; the control channel
  cannot help an engine that is stuck, so go straight to signals.
Steps are `step_grace_s` apart. The ladder resets only after `recover_s` with no bad sample since
the last step: right after a step every sample is "good" (the baseline was just re-taken), so a
count of good samples would reset the ladder while swap is still climbing.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from moed.daemon.platform import PressureLevel
from moed.protocol.units import format_bytes

_MIB = 1024 * 1024


class Action(str, enum.Enum):
    SHED_CACHE = "shed_cache"  # shrink the expert cache, release MLX's buffer cache
    SHED_CANCEL_NEWEST = "shed_cancel_newest"  # also cancel the most recently admitted request
    SHUTDOWN = "shutdown"  # graceful shutdown through the control channel
    SIGTERM = "sigterm"
    SIGKILL = "sigkill"


LADDER: tuple[Action, ...] = (
    Action.SHED_CACHE,
    Action.SHED_CANCEL_NEWEST,
    Action.SHUTDOWN,
    Action.SIGTERM,
    Action.SIGKILL,
)


class Rule(str, enum.Enum):
    MEMORY = "memory"
    PROGRESS = "progress"


class State(str, enum.Enum):
    OK = "ok"
    SUSPECT = "suspect"  # bad samples, not yet `consecutive` of them
    ESCALATING = "escalating"  # at least one step taken, not yet recovered
    EXHAUSTED = "exhausted"  # SIGKILL sent; waiting for the process to go or a new daemon


@dataclass(frozen=True)
class DaemonReading:
    reachable: bool  # answered `status`
    pid: int | None = None  # from status, the --pid override, or the last answer
    alive: bool = False  # that pid exists (and is the process we first saw under it)
    boot_id: str | None = None
    busy: bool = False
    active_requests: int = 0
    last_token_at: float | None = None  # unix time of the last token produced
    last_progress_at: float | None = None  # unix time of the last prompt chunk, layer or read


@dataclass(frozen=True)
class Sample:
    mono: float  # time.monotonic()
    wall: float  # time.time(); compared with the daemon's unix timestamps
    swap_used_bytes: int | None
    pressure: PressureLevel
    daemon: DaemonReading = field(default_factory=lambda: DaemonReading(reachable=False))
    daemon_footprint_bytes: int | None = None  # logged, not judged


@dataclass(frozen=True)
class PolicyParams:
    consecutive: int = 3
    swap_growth_bytes: int = 512 * _MIB
    progress_timeout_s: float = 120.0
    step_grace_s: float = 5.0
    act_on_critical_pressure: bool = True
    recover_s: float = 60.0  # quiet time after the last step before the ladder starts over

    @classmethod
    def from_config(cls, cfg: Any) -> PolicyParams:
        return cls(
            consecutive=max(1, int(cfg.consecutive)),
            swap_growth_bytes=int(cfg.swap_growth_mb * _MIB),
            progress_timeout_s=float(cfg.progress_timeout_s),
            step_grace_s=float(cfg.step_grace_s),
            recover_s=float(getattr(cfg, "recover_s", cls.recover_s)),
        )


@dataclass(frozen=True)
class Decision:
    action: Action | None
    rule: Rule | None
    reason: str
    state: State
    notes: tuple[str, ...]  # transitions worth logging even without an action
    readings: dict


class Policy:
    def __init__(self, params: PolicyParams):
        self.params = params
        self.baseline: int | None = None
        self.bad_streak = 0
        self.good_streak = 0
        self.step = -1  # index into LADDER of the last step taken
        self.last_action: Action | None = None
        self.last_action_mono: float | None = None
        self.last_bad_mono: float | None = None
        self.identity: tuple[int | None, str | None] | None = None
        self.busy_since_wall: float | None = None
        self.unreachable_since_wall: float | None = None

    # -- the one entry point -------------------------------------------------------------------

    def observe(self, s: Sample) -> Decision:
        notes: list[str] = []
        self._track_daemon(s, notes)
        self._track_swap(s, notes)

        memory_reason = self._memory_reason(s)
        wedged_reason = self._wedged_reason(s)
        bad = memory_reason is not None or wedged_reason is not None
        if bad:
            self.bad_streak += 1
            self.good_streak = 0
            self.last_bad_mono = s.mono
        else:
            self.good_streak += 1
            self.bad_streak = 0

        action: Action | None = None
        rule: Rule | None = None
        reason = wedged_reason or memory_reason or "ok"
        has_target = s.daemon.reachable or s.daemon.alive
        grace_over = (
            self.last_action_mono is None
            or s.mono - self.last_action_mono >= self.params.step_grace_s
        )

        if wedged_reason is not None and has_target and grace_over and self.step < len(LADDER) - 1:
            # Progress is judged on time already; no need for N samples. Skip the control steps.
            self.step = max(self.step + 1, LADDER.index(Action.SIGTERM))
            action, rule = LADDER[self.step], Rule.PROGRESS
        elif (
            memory_reason is not None
            and has_target
            and grace_over
            and self.bad_streak >= self.params.consecutive
            and self.step < len(LADDER) - 1
        ):
            self.step += 1
            action, rule = LADDER[self.step], Rule.MEMORY
            reason = f"{memory_reason} for {self.bad_streak} samples in a row"
        elif not bad and self.step >= 0 and self._quiet_for(s) >= self.params.recover_s:
            notes.append(
                f"recovered: no bad sample for {self._quiet_for(s):.1f} s "
                f"after {self.last_action.value}"
            )
            self.step = -1
        elif bad and self.bad_streak == 1 and self.step < 0:
            notes.append(f"suspect: {reason}")

        readings = self.readings(s)  # what the decision saw, before the step re-takes the baseline
        if action is not None:
            self.last_action, self.last_action_mono = action, s.mono
            self.bad_streak = 0
            # The next memory step needs fresh growth from here (see the module docstring).
            if s.swap_used_bytes is not None:
                self.baseline = s.swap_used_bytes
        return Decision(action, rule, reason, self.state, tuple(notes), readings)

    def daemon_shed(self, s: Sample) -> str:
        """The daemon shed memory itself: it recovered from a device out-of-memory in place
        (engine/recovery.py), halving its expert cache as `shed_cache` would. That is this
        ladder's first step, taken: the next memory step needs fresh swap growth from here and
        a grace, so one event is not met twice. Returns the note to log."""
        first = LADDER.index(Action.SHED_CACHE)
        if self.step < first:
            self.step, self.last_action = first, Action.SHED_CACHE
        self.last_action_mono = s.mono
        self.bad_streak = 0
        if s.swap_used_bytes is not None:
            self.baseline = s.swap_used_bytes
        return f"counted as {Action.SHED_CACHE.value}; ladder at {LADDER[self.step].value}"

    def acted(self, mono: float) -> None:
        """The step decided last was taken at `mono`: the next step's grace counts from then, not
        from the sample (acting can take a while under load: the SIGKILL must follow the SIGTERM
        by the whole grace)."""
        if self.last_action_mono is not None:
            self.last_action_mono = max(self.last_action_mono, mono)

    # -- pieces --------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        if self.step >= len(LADDER) - 1:
            return State.EXHAUSTED
        if self.step >= 0:
            return State.ESCALATING
        return State.SUSPECT if self.bad_streak > 0 else State.OK

    def _quiet_for(self, s: Sample) -> float:
        since = max(self.last_action_mono or s.mono, self.last_bad_mono or 0.0)
        return s.mono - since

    def _reset_ladder(self) -> None:
        self.step = -1
        self.bad_streak = self.good_streak = 0
        self.last_action_mono = None

    def _track_daemon(self, s: Sample, notes: list[str]) -> None:
        d = s.daemon
        if d.reachable:
            identity = (d.pid, d.boot_id)
            if self.identity is not None and identity != self.identity:
                notes.append(
                    f"daemon changed: pid {self.identity[0]} -> {d.pid}, "
                    f"boot {self.identity[1]} -> {d.boot_id}"
                )
                self._reset_ladder()
                self.baseline = s.swap_used_bytes  # a new daemon is not to blame for old swap
                self.busy_since_wall = None
            self.identity = identity
            self.unreachable_since_wall = None
            if d.busy and self.busy_since_wall is None:
                self.busy_since_wall = s.wall
            elif not d.busy:
                self.busy_since_wall = None
        else:
            if self.unreachable_since_wall is None:
                self.unreachable_since_wall = s.wall
                if self.identity is not None:
                    notes.append("daemon unreachable")
            if not d.alive and self.step >= 0 and self.identity is not None:
                # The process we were escalating against is gone: the ladder is done with it.
                notes.append(f"daemon pid {d.pid} is gone")
                self._reset_ladder()
                self.identity = None
                self.busy_since_wall = None

    def _track_swap(self, s: Sample, notes: list[str]) -> None:
        if s.swap_used_bytes is None:
            return
        if self.baseline is None:
            self.baseline = s.swap_used_bytes
            notes.append(f"swap baseline {format_bytes(s.swap_used_bytes)}")
        elif s.swap_used_bytes < self.baseline:
            self.baseline = s.swap_used_bytes  # swap shrank: measure growth from the new low

    def _memory_reason(self, s: Sample) -> str | None:
        reasons = []
        if s.swap_used_bytes is not None and self.baseline is not None:
            growth = s.swap_used_bytes - self.baseline
            if growth >= self.params.swap_growth_bytes:
                reasons.append(
                    f"swap grew {format_bytes(growth)} over its baseline "
                    f"(limit {format_bytes(self.params.swap_growth_bytes)})"
                )
        if self.params.act_on_critical_pressure and s.pressure is PressureLevel.CRITICAL:
            reasons.append("memory pressure is critical")
        return "; ".join(reasons) or None

    def _progress_ref(self, s: Sample) -> float:
        """The last sign of progress: a token, a prefill chunk, or this request becoming busy."""
        d = s.daemon
        return max(
            d.last_token_at or 0.0, d.last_progress_at or 0.0, self.busy_since_wall or s.wall
        )

    def _wedged_reason(self, s: Sample) -> str | None:
        d, timeout = s.daemon, self.params.progress_timeout_s
        if d.reachable and d.busy:
            stalled = s.wall - self._progress_ref(s)
            if stalled >= timeout:
                return (
                    f"busy with {d.active_requests} request(s) and no token for {stalled:.1f} s "
                    f"(limit {timeout:g} s)"
                )
        elif (
            not d.reachable
            and d.alive
            and self.unreachable_since_wall is not None
            and self.identity is not None
        ):
            silent = s.wall - self.unreachable_since_wall
            if silent >= timeout:
                return (
                    f"pid {d.pid} alive but not answering for {silent:.1f} s (limit {timeout:g} s)"
                )
        return None

    def readings(self, s: Sample) -> dict:
        d = s.daemon
        growth = (
            None
            if s.swap_used_bytes is None or self.baseline is None
            else s.swap_used_bytes - self.baseline
        )
        stalled = None
        if d.reachable and d.busy:
            stalled = round(s.wall - self._progress_ref(s), 3)
        return {
            "swap_used_mb": None
            if s.swap_used_bytes is None
            else round(s.swap_used_bytes / _MIB, 1),
            "swap_baseline_mb": None if self.baseline is None else round(self.baseline / _MIB, 1),
            "swap_growth_mb": None if growth is None else round(growth / _MIB, 1),
            "pressure": s.pressure.value,
            "bad_streak": self.bad_streak,
            "good_streak": self.good_streak,
            "daemon": {k: v for k, v in asdict(d).items()},
            "daemon_footprint_mb": None
            if s.daemon_footprint_bytes is None
            else round(s.daemon_footprint_bytes / _MIB, 1),
            "stalled_s": stalled,
        }
