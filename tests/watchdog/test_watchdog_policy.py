"""The escalation state machine, driven by synthetic samples (pure: no clock, no processes)."""

from __future__ import annotations

from dataclasses import replace

from moed.daemon.platform import PressureLevel
from moed.daemon.watchdog.policy import (
    LADDER,
    Action,
    DaemonReading,
    Policy,
    PolicyParams,
    Rule,
    Sample,
    State,
)

MIB = 1024 * 1024
DAEMON = DaemonReading(reachable=True, pid=4242, alive=True, boot_id="boot-1")
PARAMS = PolicyParams(
    consecutive=3, swap_growth_bytes=512 * MIB, progress_timeout_s=60.0, step_grace_s=5.0
)


class Clock:
    """Feeds one sample per `interval` seconds."""

    def __init__(self, policy: Policy, interval: float = 1.0, wall0: float = 1_700_000_000.0):
        self.policy, self.interval, self.t, self.wall0 = policy, interval, 0.0, wall0

    def feed(self, swap_mb: float | None, pressure=PressureLevel.NORMAL, daemon=DAEMON):
        self.t += self.interval
        swap = None if swap_mb is None else int(swap_mb * MIB)
        return self.policy.observe(Sample(self.t, self.wall0 + self.t, swap, pressure, daemon))


def actions(decisions):
    return [d.action for d in decisions if d.action is not None]


def test_acts_only_after_n_consecutive_bad_samples():
    clock = Clock(Policy(PARAMS))
    clock.feed(1000)  # baseline
    first = [clock.feed(1600), clock.feed(1600)]
    assert actions(first) == [] and first[-1].state is State.SUSPECT
    third = clock.feed(1600)
    assert third.action is Action.SHED_CACHE and third.rule is Rule.MEMORY
    assert "swap grew 629.1 MB" in third.reason  # 600 MiB, in the one decimal unit
    assert "3 samples in a row" in third.reason
    assert third.readings["swap_used_mb"] == 1600.0


def test_interrupted_streak_does_not_act():
    clock = Clock(Policy(PARAMS))
    clock.feed(1000)
    out = [clock.feed(mb) for mb in (1600, 1600, 900, 1600, 1600, 900, 1700, 1700)]
    assert actions(out) == []


def test_full_ladder_when_swap_keeps_growing():
    clock = Clock(Policy(PARAMS))
    clock.feed(0)
    taken: list[tuple[float, Action]] = []
    swap = 0.0
    for _ in range(200):
        swap += 300  # relentless growth: every step needs fresh growth, and gets it
        d = clock.feed(swap)
        if d.action:
            taken.append((clock.t, d.action))
    assert [a for _, a in taken] == list(LADDER)
    gaps = [b - a for (a, _), (b, _) in zip(taken, taken[1:])]
    assert all(gap >= PARAMS.step_grace_s for gap in gaps)
    assert clock.policy.state is State.EXHAUSTED
    # Nothing more to do once SIGKILL is sent, however bad it stays.
    assert actions([clock.feed(swap + 1000 * i) for i in range(1, 20)]) == []


def test_shed_that_stops_the_growth_ends_the_escalation():
    clock = Clock(Policy(PARAMS))
    clock.feed(0)
    out = [clock.feed(mb) for mb in (600, 700, 800)]
    assert actions(out) == [Action.SHED_CACHE]
    # Swap stays high (macOS keeps swapped pages out) but no longer grows: no further step...
    out = [clock.feed(800) for _ in range(int(PARAMS.recover_s) + 2)]
    assert actions(out) == []
    assert any("recovered" in n for d in out for n in d.notes)
    assert clock.policy.state is State.OK
    # ...and a later episode starts again at the bottom of the ladder.
    out = [clock.feed(mb) for mb in (1400, 1500, 1600)]
    assert actions(out) == [Action.SHED_CACHE]


def test_no_recovery_while_swap_still_climbs():
    # Right after a step the baseline is fresh, so samples look good while swap keeps climbing.
    clock = Clock(Policy(PARAMS))
    clock.feed(0)
    swap, out = 0.0, []
    for _ in range(400):
        swap += (
            20  # 20 MiB/s: the 512 MiB limit is crossed again every ~26 s, well within recover_s
        )
        out.append(clock.feed(swap))
    assert actions(out) == list(LADDER)
    assert not any("recovered" in n for d in out for n in d.notes)


def test_swap_shrinking_rebases_the_baseline():
    clock = Clock(Policy(PARAMS))
    clock.feed(2000)
    clock.feed(100)  # swap freed: growth is now measured from 100
    assert clock.policy.baseline == 100 * MIB
    out = [clock.feed(700) for _ in range(3)]
    assert actions(out) == [Action.SHED_CACHE]


def test_page_cache_churn_never_acts():
    # Free memory collapses and PSI "some" rises (reclaim), but swap is flat: nothing to do.
    clock = Clock(Policy(PARAMS))
    out = [
        clock.feed(1000 + (i % 3), PressureLevel.WARN if i % 2 else PressureLevel.NORMAL)
        for i in range(300)
    ]
    assert actions(out) == []
    assert clock.policy.state is State.OK


def test_critical_pressure_alone_escalates():
    clock = Clock(Policy(PARAMS))
    clock.feed(None)  # swap unreadable
    out = [clock.feed(None, PressureLevel.CRITICAL) for _ in range(3)]
    assert actions(out) == [Action.SHED_CACHE]
    assert "memory pressure is critical" in out[-1].reason
    off = Clock(Policy(replace(PARAMS, act_on_critical_pressure=False)))
    assert actions([off.feed(None, PressureLevel.CRITICAL) for _ in range(20)]) == []


def test_no_daemon_no_action():
    clock = Clock(Policy(PARAMS))
    gone = DaemonReading(reachable=False, pid=None, alive=False)
    clock.feed(0, daemon=gone)
    out = [clock.feed(1000 * i, daemon=gone) for i in range(1, 10)]
    assert actions(out) == []


def test_wedged_engine_gets_sigterm_then_sigkill():
    clock = Clock(Policy(PARAMS))
    last_token = clock.wall0 + 1.0
    busy = replace(DAEMON, busy=True, active_requests=1, last_token_at=last_token)
    decisions = [(clock.t, clock.feed(0, daemon=busy)) for _ in range(200)]
    taken = [(t, d) for t, d in decisions if d.action]
    assert [d.action for _, d in taken] == [Action.SIGTERM, Action.SIGKILL]
    (t_term, term), (t_kill, _) = taken
    assert term.rule is Rule.PROGRESS and "no token for" in term.reason
    assert (
        PARAMS.progress_timeout_s
        <= clock.wall0 + t_term + 1 - last_token
        <= PARAMS.progress_timeout_s + 1
    )
    assert t_kill - t_term >= PARAMS.step_grace_s


def test_a_fresh_request_after_a_long_idle_is_not_wedged():
    # last_token_at is from a request an hour ago; this one started now and is in a long prefill.
    clock = Clock(Policy(PARAMS))
    idle = replace(DAEMON, last_token_at=clock.wall0 - 3600)
    clock.feed(0, daemon=idle)
    busy = replace(idle, busy=True, active_requests=1)
    out = [clock.feed(0, daemon=busy) for _ in range(int(PARAMS.progress_timeout_s) - 2)]
    assert actions(out) == []
    out = [clock.feed(0, daemon=busy) for _ in range(5)]
    assert actions(out) == [Action.SIGTERM]


def test_tokens_flowing_is_progress():
    clock = Clock(Policy(PARAMS))
    out = []
    for _ in range(300):
        out.append(
            clock.feed(
                0,
                daemon=replace(
                    DAEMON, busy=True, active_requests=1, last_token_at=clock.wall0 + clock.t
                ),
            )
        )
    assert actions(out) == []


def test_a_long_prefill_reporting_progress_is_not_wedged():
    clock = Clock(Policy(PARAMS))
    out = []
    for _ in range(300):  # no token for 300 s, but a prefill chunk finishes every second
        busy = replace(
            DAEMON,
            busy=True,
            active_requests=1,
            last_token_at=None,
            last_progress_at=clock.wall0 + clock.t,
        )
        out.append(clock.feed(0, daemon=busy))
    assert actions(out) == []


def test_silent_but_alive_daemon_is_wedged():
    clock = Clock(Policy(PARAMS))
    clock.feed(0)  # known daemon
    silent = DaemonReading(reachable=False, pid=DAEMON.pid, alive=True)
    out = [clock.feed(0, daemon=silent) for _ in range(int(PARAMS.progress_timeout_s) + 3)]
    assert actions(out) == [Action.SIGTERM]
    assert "not answering" in [d for d in out if d.action][0].reason


def test_new_daemon_resets_the_ladder_and_the_baseline():
    clock = Clock(Policy(PARAMS))
    clock.feed(0)
    out = [clock.feed(mb) for mb in (600, 700, 800)]
    assert actions(out) == [Action.SHED_CACHE]
    reborn = replace(DAEMON, pid=5151, boot_id="boot-2")
    d = clock.feed(900, daemon=reborn)
    assert any("daemon changed" in n for n in d.notes)
    assert clock.policy.step == -1 and clock.policy.baseline == 900 * MIB


def test_gone_daemon_ends_the_escalation():
    clock = Clock(Policy(PARAMS))
    clock.feed(0)
    [clock.feed(mb) for mb in (600, 700, 800)]
    d = clock.feed(900, daemon=DaemonReading(reachable=False, pid=DAEMON.pid, alive=False))
    assert any("is gone" in n for n in d.notes)
    assert clock.policy.state is not State.ESCALATING


def test_a_recovery_in_place_counts_as_the_shed_step_it_already_was():
    """The daemon halved its expert cache itself when it recovered from an out-of-memory in place
    (engine/recovery.py): the same swap growth must not make the watchdog shed again at once.
    The next step needs fresh growth over the new baseline and a grace, and is the one after."""
    watched, unwatched = Clock(Policy(PARAMS)), Clock(Policy(PARAMS))
    for clock in (watched, unwatched):
        clock.feed(1000)  # baseline
        clock.feed(1600)  # the growth that came with the out-of-memory
    sample = Sample(watched.t, watched.wall0 + watched.t, 1600 * MIB, PressureLevel.NORMAL, DAEMON)
    note = watched.policy.daemon_shed(sample)
    assert "counted as shed_cache" in note and watched.policy.state is State.ESCALATING
    # The same two more samples at that swap: the unwatched ladder sheds, the watched one waits.
    assert actions([unwatched.feed(1600), unwatched.feed(1600)]) == [Action.SHED_CACHE]
    assert actions([watched.feed(1600) for _ in range(10)]) == []
    # Swap keeps growing after it: the next step is the one after a shed.
    grown = [watched.feed(2200) for _ in range(PARAMS.consecutive)]
    assert actions(grown) == [Action.SHED_CANCEL_NEWEST]
