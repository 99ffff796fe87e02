"""`moed serve` in a terminal: a progress bar for the model load, drawn from the engine's
published status (the engine knows nothing of terminals). Nothing when stderr is not a TTY."""

from __future__ import annotations

import sys
import threading
import time

from moed.client.progress import ProgressMode, StagedProgress, progress_mode
from moed.daemon.engine.status import DaemonState, EngineStatus

POLL_S = 0.1


def show_load_progress(status: EngineStatus) -> threading.Thread | None:
    """Follow the first load on a daemon thread until the model is ready or failed."""
    if progress_mode(False, sys.stderr) is not ProgressMode.BAR:
        return None
    thread = threading.Thread(target=_follow, args=(status,), name="moed-load-bar", daemon=True)
    thread.start()
    return thread


def _follow(status: EngineStatus) -> None:
    bar = StagedProgress("loading", ProgressMode.BAR)
    while True:
        # State first: once it is past loading, the load record already holds the last stage.
        state, load = status.get("state"), status.get("load")
        if load:
            bar.update(load["stage"], float(load["done"]), load["total"], load["unit"])
        if state not in (DaemonState.LOADING, DaemonState.LOADING.value):
            break
        time.sleep(POLL_S)
    bar.close(done=state in (DaemonState.READY, DaemonState.READY.value))
