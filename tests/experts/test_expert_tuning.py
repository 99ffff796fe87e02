"""The step tuner keeps a switch (next-layer prefetch, overlapping reads) on only where it
measurably pays, probing one switch at a time in alternate steps."""

from __future__ import annotations

from moed.daemon.experts.tuning import HOLD, WINDOW, StepTuner, Switch


def run(tuner: StepTuner, steps: int, cost) -> list[tuple[bool, ...]]:
    """Feed `steps` decode steps whose cost depends on which switches are on."""
    seen = []
    for _ in range(steps):
        state = tuple(sw.active for sw in tuner.switches)
        seen.append(state)
        tuner.on_step(cost(*state))
    return seen


def test_keeps_a_switch_that_saves_time():
    sw = Switch("a")
    seen = run(StepTuner([sw]), 2 * WINDOW + 10, lambda a: 0.010 if a else 0.012)
    assert seen[: 2 * WINDOW] == [(True,), (False,)] * WINDOW  # alternating probe
    assert all(s == (True,) for s in seen[2 * WINDOW :]) and abs(sw.net_ms - 2.0) < 1e-9


def test_alternating_steps_cancel_out_a_change_in_background_load():
    """The machine gets twice as slow halfway through the probe: on and off still compare fairly."""
    sw, steps = Switch("a"), []

    def cost(a):
        steps.append(a)
        return (0.010 if a else 0.011) * (2.0 if len(steps) > WINDOW else 1.0)

    run(StepTuner([sw]), 2 * WINDOW, cost)
    assert sw.active and sw.net_ms > 0


def test_turns_off_a_switch_that_costs_time_or_is_not_allowed():
    costly, wasteful = Switch("costly"), Switch("wasteful", allowed=lambda: False)
    run(StepTuner([costly]), 2 * WINDOW, lambda a: 0.013 if a else 0.012)
    run(StepTuner([wasteful]), 2 * WINDOW, lambda a: 0.010 if a else 0.012)  # faster, not allowed
    assert not costly.active and costly.net_ms < 0 and not wasteful.active


def test_probes_one_switch_at_a_time_and_again_after_holding():
    a, b = Switch("a"), Switch("b")
    tuner = StepTuner([a, b])
    # a pays, b costs: while a is probed b stays on; then b is probed with a as decided.
    seen = run(tuner, 4 * WINDOW, lambda x, y: 0.010 - 0.002 * x + 0.001 * y)
    assert seen[0] == (True, True) and seen[1] == (False, True)
    assert seen[2 * WINDOW] == (True, True) and seen[2 * WINDOW + 1] == (True, False)
    assert (a.active, b.active) == (True, False)
    run(tuner, HOLD * WINDOW - 1, lambda x, y: 0.010)  # held
    assert (a.active, b.active) == (True, False)
    run(tuner, 2, lambda x, y: 0.010)  # a new round: a is probed again, alternating
    assert (a.active, b.active) == (False, False)


def test_a_stopped_tuner_leaves_every_switch_off_for_good():
    """`stop` (ExpertStreamer.hold_tuning: a bench measures one setting): every switch off, in
    the middle of a probe or not, and no round ever turns one on again."""
    a, b = Switch("a"), Switch("b")
    tuner = StepTuner([a, b])
    run(tuner, 3, lambda x, y: 0.010)  # mid-probe: a alternating
    tuner.stop()
    assert (a.active, b.active) == (False, False) and tuner.switches == []
    for _ in range(2 * HOLD * WINDOW + 2 * WINDOW):  # past a hold, when a new round would start
        tuner.on_step(0.010)
    assert (a.active, b.active) == (False, False)
