"""The watchdog process: startup -> sample/decide/act loop -> shutdown.

Signal handlers only set a flag (uvicorn style); the loop notices it within one interval.
Actions go through the daemon's control channel first and use signals only as a last resort.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from moed.daemon.config import WatchdogConfig
from moed.daemon.ground.watchdog_state import read_recovery, state_file_path, write_state
from moed.daemon.platform import MemoryProbe, probe_for_platform
from moed.daemon.watchdog.events import EventLog, default_event_log
from moed.daemon.watchdog.policy import Action, Decision, Policy, PolicyParams, Sample
from moed.daemon.watchdog.sampler import DaemonLink, Sampler, Target
from moed.protocol import ShedLevel

log = logging.getLogger("moed.watchdog")

HEARTBEAT_S = 10.0  # the state file is rewritten at least this often, so readers can tell we live

_SHED_LEVEL = {
    Action.SHED_CACHE: ShedLevel.CACHE,
    Action.SHED_CANCEL_NEWEST: ShedLevel.CANCEL_NEWEST,
}
_SIGNAL = {Action.SIGTERM: signal.SIGTERM, Action.SIGKILL: signal.SIGKILL}


class Watchdog:
    def __init__(
        self,
        config: WatchdogConfig,
        *,
        probe: MemoryProbe | None = None,
        link: DaemonLink | None = None,
        pid_override: int | None = None,
        send_signal: Callable[[int, int], None] = os.kill,
    ):
        self.config = config
        self.params = PolicyParams.from_config(config)
        self.policy = Policy(self.params)
        self.probe = probe or probe_for_platform()
        # A status answer slower than an interval is as good as none; cap it so the loop keeps time.
        self.link = link or DaemonLink(
            config.socket, timeout_s=min(max(config.interval_s, 0.2), 2.0)
        )
        self.sampler = Sampler(self.probe, self.link, pid_override)
        self.send_signal = send_signal
        self.event_log_path = (
            default_event_log(config.state_dir) if not config.event_log else _path(config.event_log)
        )
        self.state_path = state_file_path(config.state_dir)
        self.events: EventLog | None = None
        self.should_exit = threading.Event()
        self.exit_reason = ""
        self.started_at = time.time()
        self.last_action: dict | None = None
        self.last_decision: Decision | None = None
        self._last_state_write = 0.0
        self._published_key: tuple | None = None
        self.daemon_recovery: dict | None = None  # the daemon's last recovery in place seen

    # ---- lifecycle ---------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.exit_reason = signal.Signals(signum).name
        self.should_exit.set()

    def startup(self) -> None:
        self.events = EventLog(self.event_log_path)
        self.events.write(
            "start",
            pid=os.getpid(),
            probe=self.probe.name,
            socket=str(self.config.socket),
            params=asdict(self.params),
            interval_s=self.config.interval_s,
            target_pid=self.sampler.pid_override,
        )
        log.info(
            "watchdog %d guarding %s (probe %s)", os.getpid(), self.config.socket, self.probe.name
        )

    def run(self) -> int:
        self.startup()
        try:
            while not self.should_exit.is_set():
                started = time.monotonic()
                self.tick()
                self.should_exit.wait(
                    max(0.0, self.config.interval_s - (time.monotonic() - started))
                )
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        reason = self.exit_reason or "stopped"
        if self.events is not None:
            self.events.write("stop", reason=reason)
            self.events.close()
        self._publish(force=True, stopped=reason)
        self.link.close()
        log.info("watchdog stopped (%s)", reason)

    # ---- one round ---------------------------------------------------------------------------
    def tick(self) -> Decision:
        sample = self.sampler.sample()
        self._note_recovery(sample)
        decision = self.policy.observe(sample)
        self.last_decision = decision
        for note in decision.notes:
            log.info("%s", note)
            self._event("note", note=note, state=decision.state, readings=decision.readings)
        if decision.action is not None:
            outcome = self.act(decision, sample.daemon.pid)
            # Taken before the grace's clock: the next step, sent a grace after that clock, is
            # at least a grace after `at` (the event's `ts` comes after the log lines).
            acted_at = time.time()
            self.policy.acted(self.sampler.clock())  # the clock the samples are stamped with
            self.last_action = {
                "action": decision.action.value,
                "rule": decision.rule.value if decision.rule else None,
                "reason": decision.reason,
                "at": acted_at,
                "outcome": outcome,
            }
            log.warning(
                "%s (%s): %s -> %s",
                decision.action.value,
                decision.rule.value,
                decision.reason,
                outcome,
            )
            self._event(
                "action",
                at=acted_at,
                action=decision.action,
                rule=decision.rule,
                reason=decision.reason,
                outcome=outcome,
                state=decision.state,
                readings=decision.readings,
            )
        self._publish(force=decision.action is not None or bool(decision.notes))
        return decision

    def _note_recovery(self, sample: Sample) -> None:
        """A recovery in place the daemon reported since the last look (ground/watchdog_state.py):
        an out-of-memory one is the shed this ladder would take, so it counts as taken."""
        record = read_recovery(self.config.state_dir)
        if record is None or record["at"] < self.started_at:
            return  # none, or before this watchdog started: not ours to count
        seen = self.daemon_recovery
        if seen is not None and (seen.get("boot_id"), seen.get("at")) == (
            record.get("boot_id"),
            record["at"],
        ):
            return
        self.daemon_recovery = record
        note = f"the daemon recovered in place from {record.get('kind')}"
        if record.get("kind") == "out_of_memory":
            note = f"{note}; {self.policy.daemon_shed(sample)}"
        log.warning("%s", note)
        self._event("recovery", note=note, recovery=record)
        self._publish(force=True)

    def act(self, decision: Decision, pid: int | None) -> dict:
        action = decision.action
        reason = f"watchdog: {decision.reason}"
        try:
            if action in _SHED_LEVEL:
                return {
                    "ok": True,
                    "reply": _trim(self.link.call("shed", _SHED_LEVEL[action].value, reason)),
                }
            if action is Action.SHUTDOWN:
                # restart=True: the daemon exits non-zero, so launchd/systemd bring it back with a
                # smaller budget.
                return {
                    "ok": True,
                    "reply": _trim(self.link.call("shutdown", reason, restart=True)),
                }
            if action in _SIGNAL:
                target = self.sampler.target
                if target is None or pid is None or target.pid != pid:
                    return {"ok": False, "error": "no daemon pid known"}
                if not target.alive():
                    return {"ok": False, "error": f"pid {pid} is no longer the daemon"}
                self.send_signal(pid, _SIGNAL[action])
                return {"ok": True, "pid": pid, "signal": _SIGNAL[action].name}
        except Exception as exc:  # a failed step is logged; the ladder moves on after the grace
            return {"ok": False, "error": f"{exc.__class__.__name__}: {exc}"}
        return {"ok": False, "error": f"unknown action {action}"}

    # ---- reporting ---------------------------------------------------------------------------
    def _event(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.write(event, **fields)

    def snapshot(self) -> dict:
        d = self.last_decision
        return {
            "pid": os.getpid(),
            "started_at": self.started_at,
            "updated_at": time.time(),
            "heartbeat_s": HEARTBEAT_S,
            "socket": str(self.config.socket),
            "event_log": str(self.event_log_path),
            "probe": self.probe.name,
            "state": d.state.value if d else "starting",
            "reason": d.reason if d else None,
            "readings": d.readings if d else None,
            "last_action": self.last_action,
            "daemon_recovery": self.daemon_recovery,
            "params": asdict(self.params),
        }

    def _publish(self, force: bool = False, stopped: str | None = None) -> None:
        now = time.monotonic()
        d = self.last_decision
        key = (d.state if d else None, json.dumps(self.last_action, sort_keys=True, default=str))
        if not force and key == self._published_key and now - self._last_state_write < HEARTBEAT_S:
            return
        state = self.snapshot()
        if stopped:
            state.update(state="stopped", stopped_at=time.time(), stop_reason=stopped)
        try:
            write_state(self.state_path, state)
        except OSError as exc:
            log.error("cannot write %s: %s", self.state_path, exc)
        self._published_key, self._last_state_write = key, now


def _trim(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("v", "type", "id")}


def _path(text: str):
    from pathlib import Path

    return Path(text).expanduser()


__all__ = ["Watchdog", "Target"]
