"""The progress deadline, model by model: a model with work must move, an idle or unloaded one
needs not. A stalled model fails its own streams (`engine_stalled`) and refuses new work; the
others serve on. For the watchdog and /health, the busy model that moved least recently speaks
for the daemon (its `busy`, `last_token_at`, `last_progress_at`), so a model that makes no
progress because it has nothing to do never makes the daemon look wedged.
"""

from __future__ import annotations

from typing import Any

from moed.daemon.transport.model_set import ModelSet, ServedModel


def newly_stalled(models: ModelSet, now: float | None = None) -> list[ServedModel]:
    """The models whose work passed the deadline with no progress since the last check."""
    stalled = []
    for model in models.models():
        was_stalled = model.progress.stalled_at is not None
        if model.progress.check(model.status.snapshot(), bool(model.streams), now):
            if not was_stalled:
                stalled.append(model)
    return stalled


def progress_fields(models: ModelSet, now: float | None = None) -> dict[str, Any]:
    """The `status` body's progress fields for the daemon as a whole."""
    snaps = [(m, m.status.snapshot()) for m in models.models()]
    busy = [(m, snap) for m, snap in snaps if m.streams or snap.get("busy")]
    if busy:  # the stalest busy model: a wedge anywhere shows
        model, snap = min(busy, key=lambda pair: pair[0].progress.last_progress(pair[1]) or 0.0)
    else:
        model = models.started
        snap = next((s for m, s in snaps if m is model), {}) or model.status.snapshot()
    fields = {
        "busy": bool(busy),
        "active_requests": sum(int(s.get("active_requests") or 0) for _, s in snaps),
        "last_token_at": snap.get("last_token_at"),
        **model.progress.describe(snap, now),
    }
    fields["stalled"] = any(m.progress.stalled_at is not None for m, _ in snaps)
    return fields
