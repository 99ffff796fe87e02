"""The prefetch-next governor keeps speculation on only where it measurably pays."""

from __future__ import annotations

from moed.daemon.experts.speculation import HOLD, MIN_ACCURACY, WINDOW, PrefetchGovernor


def run(gov: PrefetchGovernor, windows: int, on_s: float, off_s: float, accuracy: float) -> list:
    """Feed `windows` probe windows; step time and guesses depend on whether speculation runs."""
    seen = []
    for _ in range(windows * WINDOW):
        seen.append(gov.active)
        if gov.active:
            gov.on_step(on_s, used=round(10 * accuracy), guessed=10)
        else:
            gov.on_step(off_s, used=0, guessed=0)
    return seen


def test_stays_on_when_it_saves_time_and_guesses_well():
    gov = PrefetchGovernor()
    seen = run(gov, 2 + HOLD, on_s=0.010, off_s=0.012, accuracy=0.6)
    assert seen[:WINDOW] == [True] * WINDOW and seen[WINDOW : 2 * WINDOW] == [False] * WINDOW
    assert all(seen[2 * WINDOW :])  # held on after the probe
    assert abs(gov.net_ms - 2.0) < 1e-9 and abs(gov.accuracy - 0.6) < 1e-9


def test_turns_off_when_it_costs_time():
    gov = PrefetchGovernor()
    seen = run(gov, 2 + HOLD, on_s=0.013, off_s=0.012, accuracy=0.9)
    assert not any(seen[2 * WINDOW :]) and gov.net_ms < 0


def test_turns_off_when_its_guesses_are_wasted_even_if_faster():
    gov = PrefetchGovernor()
    run(gov, 2, on_s=0.010, off_s=0.012, accuracy=MIN_ACCURACY / 2)
    assert not gov.active


def test_probes_again_after_holding():
    gov = PrefetchGovernor()
    run(gov, 1 + HOLD, on_s=0.013, off_s=0.012, accuracy=0.9)  # probed, off, still holding
    assert not gov.active
    run(gov, 1, on_s=0.010, off_s=0.012, accuracy=0.9)  # the hold is over: probing on again
    assert gov.active
    seen = run(gov, 2 + HOLD, on_s=0.010, off_s=0.012, accuracy=0.9)  # and now it pays
    assert gov.active and all(seen[2 * WINDOW :]) and gov.switches == 4  # probes count
