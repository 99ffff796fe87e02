"""The crash record: unclean-exit detection, budget backoff and its restoration, the restart budget,
and the fault-injection setting (pure functions over a temp state dir)."""

from __future__ import annotations

import json
import time

import pytest

from moed.daemon.ground.crashlog import (
    CrashKind,
    begin_run,
    end_run,
    plan_start,
    record_crash,
)
from moed.daemon.ground.faults import METAL_OOM_MESSAGE, Fault, Faults

WINDOW = 600.0
DEAD = lambda pid: False  # noqa: E731
ALIVE = lambda pid: True  # noqa: E731


def test_first_start_is_clean(tmp_path):
    plan = plan_start(tmp_path, restart_budget=5, window_s=WINDOW)
    assert (
        plan.last_crash is None
        and plan.budget_factor == 1.0
        and plan.refuse is None
        and plan.unclean_previous is None
    )


def test_clean_exit_leaves_no_trace(tmp_path):
    begin_run(tmp_path, "boot-1", pid=111)
    end_run(tmp_path, "boot-1")
    plan = plan_start(tmp_path, 5, WINDOW, pid_alive=DEAD)
    assert plan.unclean_previous is None and plan.budget_factor == 1.0


def test_a_run_that_vanished_counts_as_an_unclean_exit(tmp_path):
    begin_run(tmp_path, "boot-1", pid=111)  # then SIGKILL: nothing else written
    plan = plan_start(tmp_path, 5, WINDOW, pid_alive=DEAD)
    assert plan.unclean_previous["boot_id"] == "boot-1"
    assert plan.last_crash["kind"] == "unclean_exit" and plan.budget_factor == 0.5
    # Counted once: a second look finds no run marker.
    assert plan_start(tmp_path, 5, WINDOW, pid_alive=DEAD).recent_crashes == 1


def test_a_live_previous_run_is_not_a_crash(tmp_path):
    begin_run(tmp_path, "boot-1", pid=111)  # another daemon still running (bind will refuse)
    assert plan_start(tmp_path, 5, WINDOW, pid_alive=ALIVE).unclean_previous is None


def test_recorded_oom_is_not_counted_twice(tmp_path):
    begin_run(tmp_path, "boot-1", pid=111)
    record_crash(tmp_path, CrashKind.OUT_OF_MEMORY, METAL_OOM_MESSAGE, "boot-1")
    plan = plan_start(tmp_path, 5, WINDOW, pid_alive=DEAD)
    assert plan.recent_crashes == 1 and plan.unclean_previous is None
    assert (
        plan.last_crash["kind"] == "out_of_memory"
        and "Insufficient Memory" in plan.last_crash["message"]
    )
    data = json.loads((tmp_path / "crash.json").read_text())
    assert "run" not in data


def test_backoff_halves_per_memory_crash_down_to_an_eighth_and_recovers(tmp_path):
    t0 = 1_000_000.0
    for i in range(5):
        record_crash(tmp_path, CrashKind.OUT_OF_MEMORY, "oom", f"b{i}")
    factors = []
    data = json.loads((tmp_path / "crash.json").read_text())
    for n in range(6):
        d = dict(data, history=[dict(e, at=t0) for e in data["history"][:n]])
        (tmp_path / "crash.json").write_text(json.dumps(d))
        factors.append(plan_start(tmp_path, 0, WINDOW, now=t0 + 1).budget_factor)
    assert factors == [1.0, 0.5, 0.25, 0.125, 0.125, 0.125]
    # A stable period (the crashes age out of the window) restores the full budget.
    assert plan_start(tmp_path, 0, WINDOW, now=t0 + WINDOW + 1).budget_factor == 1.0


def test_load_failures_count_for_the_restart_budget_but_do_not_shrink_the_cache(tmp_path):
    record_crash(tmp_path, CrashKind.LOAD_FAILED, "no such file", "b1")
    plan = plan_start(tmp_path, 5, WINDOW)
    assert plan.recent_crashes == 1 and plan.budget_factor == 1.0


def test_restart_budget(tmp_path):
    for i in range(3):
        record_crash(tmp_path, CrashKind.OUT_OF_MEMORY, "oom", f"b{i}")
    assert plan_start(tmp_path, 4, WINDOW).refuse is None
    refuse = plan_start(tmp_path, 3, WINDOW).refuse
    assert "3 crashes in the last 10 minutes" in refuse and "crash.json" in refuse
    assert plan_start(tmp_path, 0, WINDOW).refuse is None  # 0: no budget


def test_corrupt_record_reads_as_empty(tmp_path):
    (tmp_path / "crash.json").write_text("{not json")
    assert plan_start(tmp_path, 5, WINDOW).last_crash is None
    record_crash(tmp_path, CrashKind.OUT_OF_MEMORY, "oom", "b")
    assert json.loads((tmp_path / "crash.json").read_text())["last"]["kind"] == "out_of_memory"


def test_faults_setting():
    assert not Faults.parse("")
    f = Faults.parse("oom_after=3, hang_after=10")
    assert f.after == {Fault.OOM: 3, Fault.HANG: 10}
    f.before_step(2)  # nothing yet
    with pytest.raises(RuntimeError, match="Insufficient Memory"):
        f.before_step(3)
    for bad in ("oom=3", "explode_after=1", "oom_after=x"):
        with pytest.raises(ValueError):
            Faults.parse(bad)
    slow = Faults.parse("step_delay_ms=30")  # every step sleeps: a request stays in flight
    t0 = time.monotonic()
    slow.before_step(0)
    assert time.monotonic() - t0 >= 0.03
