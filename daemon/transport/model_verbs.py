"""`models`: list what is servable and what is loaded, load a model now, unload one. Answered on
the transport thread: a load is queued on the model's engine and never waits here."""

from __future__ import annotations

from typing import Any

from moed.daemon.transport.model_set import ModelSet
from moed.protocol import ModelsAction
from moed.protocol import messages as wire


def models_reply(models: ModelSet, req_id: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """The reply to a validated `models` message (a refusal raises ProtocolError)."""
    action = ModelsAction(msg.get("action") or ModelsAction.LIST.value)
    if action is ModelsAction.LIST:
        return wire.result(req_id, **models_listing(models))
    model = models.route(msg.get("model"))
    if action is ModelsAction.LOAD:
        models.load(model)
        return wire.result(req_id, accepted=True, action=action.value, model=model.name)
    models.unload(model)
    return wire.result(
        req_id, accepted=True, action=action.value, model=model.name, requests=len(model.streams)
    )


def models_listing(models: ModelSet) -> dict[str, Any]:
    """`servable`: every model a request may name (loaded or not, with its context length);
    `loaded`: the ones loaded or loading now, most recently used first; the shared budget."""
    loaded = sorted(models.loaded_models(), key=lambda m: m.last_used, reverse=True)
    return {
        "servable": [s.describe() for s in models.catalog.listing()],
        "loaded": [m.describe() for m in loaded],
        "capacity_bytes": models.capacity,
        "used_bytes": sum(models.footprint(m) for m in loaded),
    }
