"""The bodies of `welcome` and `status`: what a client learns about the daemon and its limits."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moed.daemon import __version__
from moed.daemon.engine.status import DaemonState
from moed.daemon.ground.watchdog_state import read_state as read_watchdog_state
from moed.daemon.transport.model_progress import progress_fields
from moed.protocol import MAX_FRAME_BYTES, PROTOCOL_MAJOR, PROTOCOL_MINOR, PrefixCacheAction
from moed.protocol import messages as wire
from moed.protocol.codec import MAX_DEPTH

if TYPE_CHECKING:  # the Server whose bodies these are (server.py imports this module)
    from moed.daemon.transport.server import Server


def watchdog_summary(state_dir: Path) -> dict[str, Any] | None:
    """The watchdog's published state (it shares the state directory), for `moe status`."""
    state = read_watchdog_state(state_dir)
    if state is None:
        return None
    keep = ("running", "state", "reason", "last_action", "pid", "updated_at")
    return {k: state.get(k) for k in keep}


def welcome_body(self: Server) -> dict[str, Any]:
    """The `welcome` body; `self` is the Server."""
    snap = self.status.snapshot()
    return {
        "protocol": {"major": PROTOCOL_MAJOR, "minor": PROTOCOL_MINOR},
        "boot_id": self.boot_id,
        "pid": os.getpid(),
        "version": __version__,
        "state": snap["state"],
        "model": snap.get("model") or {"path": str(self.model_path), "name": self.model_path.name},
        "limits": {
            **self.limits.describe(),
            "max_frame_bytes": MAX_FRAME_BYTES,
            "max_depth": MAX_DEPTH,
            "max_pending": self.serve.max_pending,
            "max_pending_per_client": self.serve.max_pending_per_client,
            "client_send_hwm": self.serve.client_send_hwm,
            "progress_deadline_s": self.serve.progress_deadline_s,
            "max_connections": self.connections.limit,
        },
        "last_crash": self.start_plan.last_crash,
        "budget_backoff": self.budget_backoff,
        **self.extra_welcome,
    }


def status_body(self: Server) -> dict[str, Any]:
    """The `status` body: the engine's snapshot, the progress deadline, crashes, the watchdog."""
    snap = self.status.snapshot()
    snap.pop("prefix_entries", None)  # `prefix_cache` lists them; status stays small
    snap.update(progress_fields(self.models))  # the busy models' progress, not an idle one's
    if snap["stalled"]:
        snap["state"] = DaemonState.STALLED.value  # the transport's verdict over the engine's state
    snap["pending_requests"] = len(self._streams)
    self.connections.drain()
    snap.update(self.connections.describe())  # client connections now, and the limit
    snap["boot_id"] = self.boot_id
    snap["pid"] = os.getpid()
    snap["uptime_s"] = time.time() - snap["started_at"]
    snap["rss_bytes"] = self._process.memory_info().rss
    snap["last_crash"] = self.start_plan.last_crash
    snap["recent_crashes"] = self.start_plan.recent_crashes  # within the restart window
    snap["budget_backoff"] = self.budget_backoff
    snap["watchdog"] = watchdog_summary(self.serve.state_dir)
    snap["models"] = [m.describe() for m in self.models.loaded_models()]  # `moe ps`
    snap.update(self.extra_welcome)
    return snap


def prefix_cache_reply(self: Server, req_id: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """`prefix_cache`: list a model's cache (`model`; none: the started one) from its engine's last
    published view, or queue its clearing (the engine thread owns the tiers; a later list shows it
    empty; an unloaded model's SSD folder is cleared all the same). `self` is the Server."""
    action = PrefixCacheAction(msg.get("action") or PrefixCacheAction.LIST.value)
    model = self.models.route(msg.get("model"))
    if action is PrefixCacheAction.CLEAR:
        self.control_token.require("prefix_cache clear", msg.get("token"))
        model.engine.clear_prefix_cache()
        return wire.result(req_id, accepted=True, action=action.value, model=model.name)
    stats = model.status.get("prefix_cache")
    return wire.result(
        req_id,
        model=model.name,
        enabled=stats is not None,
        stats=stats,
        entries=model.status.get("prefix_entries") or [],
    )
