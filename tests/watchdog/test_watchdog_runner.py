"""The watchdog process: its loop against a real daemon, its CLI, signals, event log and state
file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moed.daemon.ground.watchdog_state import read_state
from moed.daemon.platform import PressureLevel
from moed.daemon.watchdog.events import EventLog, read_events
from moed.daemon.watchdog.policy import LADDER, Action
from moed.daemon.watchdog.runner import Watchdog
from moed.daemon.watchdog.sampler import Target
from tests.fixtures.daemon_harness import stop_process, watchdog_command
from tests.fixtures.watchdog import ScriptedProbe, watchdog_config

pytestmark = [pytest.mark.serial, pytest.mark.process]


def test_pressure_escalates_through_the_control_channel(daemon, tmp_path):
    probe = ScriptedProbe()
    signals: list[tuple[int, int]] = []
    # A grace long enough for the daemon to finish its graceful exit before a signal would be due.
    dog = Watchdog(
        watchdog_config(tmp_path, daemon.socket, step_grace_s=1.0),
        probe=probe,
        send_signal=lambda pid, sig: signals.append((pid, sig)),
    )
    dog.startup()
    try:
        assert dog.tick().action is None  # baseline, daemon known
        probe.pressure = PressureLevel.CRITICAL
        taken = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and daemon.proc.poll() is None:
            d = dog.tick()
            if d.action:
                taken.append(d.action)
            time.sleep(0.05)
        # shed (cache), shed (cancel newest), then a graceful shutdown the daemon honours.
        assert taken == [Action.SHED_CACHE, Action.SHED_CANCEL_NEWEST, Action.SHUTDOWN]
        # Exit 5 (not 0): launchd/systemd restart it, and the crash record backs its budget off.
        assert daemon.proc.wait(15) == 5
        crash = json.loads((daemon.state_dir / "crash.json").read_text())
        assert crash["last"]["kind"] == "memory_pressure"
        assert (
            "shed requested: level=cache" in daemon.log()
            and "shed requested: level=cancel_newest" in daemon.log()
        )
        # The daemon is gone: no signal goes to its (possibly recycled) pid.
        for _ in range(10):
            dog.tick()
        assert signals == []
    finally:
        dog.shutdown()
    events = read_events(dog.event_log_path)
    assert [e["event"] for e in events][0] == "start" and events[-1]["event"] == "stop"
    actions = [e for e in events if e["event"] == "action"]
    assert [a["action"] for a in actions] == ["shed_cache", "shed_cancel_newest", "shutdown"]
    assert all(
        "memory pressure is critical" in a["reason"] and a["readings"]["pressure"] == "critical"
        for a in actions
    )
    assert actions[0]["outcome"] == {"ok": True, "reply": {"accepted": True, "level": "cache"}}
    state = json.loads(dog.state_path.read_text())
    assert state["state"] == "stopped" and state["last_action"]["action"] == "shutdown"


def test_the_daemon_status_shows_the_watchdog(daemon, tmp_path):
    # Same state directory as the daemon: `moe status` (the daemon's status) carries the watchdog.
    dog = Watchdog(
        watchdog_config(tmp_path, daemon.socket, state_dir=daemon.state_dir), probe=ScriptedProbe()
    )
    dog.startup()
    try:
        dog.tick()
        with daemon.client() as c:
            wd = c.status()["watchdog"]
        assert (
            wd["running"]
            and wd["state"] == "ok"
            and wd["pid"] == os.getpid()
            and wd["last_action"] is None
        )
    finally:
        dog.shutdown()
    with daemon.client() as c:
        assert c.status()["watchdog"]["running"] is False


def test_signals_go_only_to_the_process_first_seen(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sent: list[tuple[int, int]] = []
        dog = Watchdog(
            watchdog_config(tmp_path, tmp_path / "none.sock"),
            probe=ScriptedProbe(),
            pid_override=child.pid,
            send_signal=lambda pid, sig: sent.append((pid, sig)),
        )
        decision = type("D", (), {"action": Action.SIGTERM, "reason": "test"})()
        assert dog.act(decision, child.pid)["ok"]
        # Same pid, another process (a recycled pid): refused.
        dog.sampler.target = Target(child.pid, dog.sampler.target.create_time - 100)
        outcome = dog.act(decision, child.pid)
        assert not outcome["ok"] and "no longer the daemon" in outcome["error"]
        assert sent == [(child.pid, signal.SIGTERM)]
        dog.link.close()
    finally:
        child.kill()
        child.wait()


def test_cli_once(daemon):
    out = subprocess.run(
        watchdog_command(daemon.socket, daemon.state_dir, "--once"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["state"] == "ok"
    assert (
        report["readings"]["daemon"]["reachable"]
        and report["readings"]["daemon"]["pid"] == daemon.proc.pid
    )
    assert report["readings"]["swap_used_mb"] is not None


def test_cli_stops_cleanly_on_sigterm(tmp_path):
    state_dir = tmp_path / "wd"
    proc = subprocess.Popen(
        watchdog_command(tmp_path / "none.sock", state_dir, "--interval", "0.2"),
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while read_state(state_dir) is None and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        assert read_state(state_dir)["running"]
        assert stop_process(proc, 30) == 0  # a generous bound: a hang, not a slow machine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    state = read_state(state_dir)
    assert (
        state["state"] == "stopped" and state["stop_reason"] == "SIGTERM" and not state["running"]
    )
    assert [e["event"] for e in read_events(state_dir / "watchdog.jsonl")] == [
        "start",
        "note",
        "stop",
    ]


def test_cli_rejects_nonsense():
    out = subprocess.run(
        [sys.executable, "-m", "moed.daemon.cli", "watchdog", "--interval", "0", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # A configuration error: exit 2, the setting, the value and what is allowed; no traceback.
    assert out.returncode == 2 and "interval_s" in out.stderr and "> 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_event_log_appends_whole_lines(tmp_path):
    path = tmp_path / "w.jsonl"
    with EventLog(path) as log:
        log.write("action", action=Action.SHED_CACHE, reason="r", readings={"swap_used_mb": 1.0})
    with open(path, "a") as f:
        f.write('{"torn": ')  # a crash mid-write in some other writer
    with EventLog(path) as log:
        log.write("stop", reason="x")
    events = read_events(path)
    assert [e["event"] for e in events] == [
        "action",
        "stop",
    ]  # the torn line is skipped, nothing else
    assert events[0]["action"] == "shed_cache" and events[0]["ts"] > 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_recovery_in_place_reported_by_the_daemon_counts_once_as_a_shed(tmp_path):
    """The daemon recovered from an out-of-memory in place and reported it (ground/watchdog_state
    .py, as engine/loop.py does): the watchdog counts it as its own shed step, once, and keeps it
    in its state file; the same report seen again, or one older than the watchdog, is not news."""
    from moed.daemon.ground.watchdog_state import report_recovery

    config = watchdog_config(tmp_path, tmp_path / "none.sock")
    config.state_dir.mkdir()
    old = {"kind": "out_of_memory", "at": time.time() - 3600, "boot_id": "b"}
    report_recovery(config.state_dir, old)
    dog = Watchdog(config, probe=ScriptedProbe())
    try:
        dog.startup()
        dog.tick()
        assert dog.daemon_recovery is None and dog.policy.step == -1  # before this watchdog
        record = {"kind": "out_of_memory", "at": time.time(), "boot_id": "b", "pid": 7, "shed": {}}
        report_recovery(config.state_dir, record)
        for _ in range(3):
            dog.tick()
        assert dog.policy.step == list(LADDER).index(Action.SHED_CACHE)
        assert dog.policy.last_action is Action.SHED_CACHE
        events = [e for e in read_events(dog.event_log_path) if e["event"] == "recovery"]
        assert len(events) == 1 and "counted as shed_cache" in events[0]["note"]
        assert read_state(config.state_dir)["daemon_recovery"]["pid"] == 7
    finally:
        dog.shutdown()
