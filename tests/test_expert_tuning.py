"""The step tuner keeps a switch (next-layer prefetch, overlapping reads) on only where it
measurably pays, probing one switch at a time."""

from __future__ import annotations

from moed.daemon.experts.tuning import HOLD, WINDOW, StepTuner, Switch


def run(tuner: StepTuner, windows: int, cost) -> list[tuple[bool, ...]]:
    """Feed `windows` windows of steps whose cost depends on which switches are on."""
    seen = []
    for _ in range(windows * WINDOW):
        state = tuple(sw.active for sw in tuner.switches)
        seen.append(state)
        tuner.on_step(cost(*state))
    return seen


def test_keeps_a_switch_that_saves_time():
    sw = Switch("a")
    seen = run(StepTuner([sw]), 2 + HOLD - 1, lambda a: 0.010 if a else 0.012)
    assert seen[:WINDOW] == [(True,)] * WINDOW and seen[WINDOW] == (False,)
    assert all(s == (True,) for s in seen[2 * WINDOW :]) and abs(sw.net_ms - 2.0) < 1e-9


def test_turns_off_a_switch_that_costs_time_or_is_not_allowed():
    costly, wasteful = Switch("costly"), Switch("wasteful", allowed=lambda: False)
    run(StepTuner([costly]), 2, lambda a: 0.013 if a else 0.012)
    run(StepTuner([wasteful]), 2, lambda a: 0.010 if a else 0.012)  # faster, but not allowed
    assert not costly.active and costly.net_ms < 0 and not wasteful.active


def test_probes_one_switch_at_a_time_and_again_after_holding():
    a, b = Switch("a"), Switch("b")
    tuner = StepTuner([a, b])
    # a pays, b costs: probing a holds b on; probing b keeps a at its decided value.
    seen = run(tuner, 4, lambda x, y: 0.010 - 0.002 * x + 0.001 * y)
    assert seen[0] == (True, True) and seen[WINDOW] == (False, True)
    assert seen[2 * WINDOW] == (True, True) and seen[3 * WINDOW] == (True, False)
    assert (a.active, b.active) == (True, False)
    run(tuner, HOLD, lambda x, y: 0.010)  # held; then a is probed again (b as decided)
    assert (a.active, b.active) == (True, False)
    run(tuner, 1, lambda x, y: 0.010)
    assert (a.active, b.active) == (False, False)  # the probe's window with a off
