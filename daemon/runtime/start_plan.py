"""How this start goes, decided before anything binds: what the crash record says (refuse, poison
requests) and, after recent crashes, a smaller expert cache budget (resolved to bytes)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from moed.daemon.config import ModelEntry, ServeConfig
from moed.daemon.experts.budget import CacheBudget
from moed.daemon.experts.memory_plan import plan_memory
from moed.daemon.ground import crashlog
from moed.daemon.model.loader import streaming_config
from moed.daemon.transport.plan import ServerPlan
from moed.protocol.model_config import ModelConfig

log = logging.getLogger("moed.server")


def plan_start(
    serve: ServeConfig,
    model_path: Path,
    models: tuple[ModelEntry, ...] = (),
    others: ServeConfig | None = None,
) -> ServerPlan:
    """The plan the server starts with: the crash record read once, the budget backed off."""
    crashes = crashlog.plan_start(serve.state_dir, serve.restart_budget, serve.restart_window_s)
    serve, backoff = back_off_budget(serve, model_path, crashes)
    return ServerPlan(serve, model_path, crashes, backoff, models, others)


def back_off_budget(
    serve: ServeConfig, model_path: Path, plan: crashlog.StartPlan
) -> tuple[ServeConfig, dict | None]:
    """Shrink the expert cache budget by the crash backoff factor (resolved to bytes first)."""
    if plan.budget_factor >= 1.0:
        return serve, None
    info = {**plan.describe(), "budget": str(serve.cache_budget)}
    if serve.resident:
        return serve, info  # nothing to shrink: every expert is resident by request
    try:
        model_config = ModelConfig.read(model_path)
        full = plan_memory(model_path, streaming_config(serve, model_config)).cache_budget_bytes
    except Exception as exc:  # a model that cannot be planned fails at load with a better message
        log.warning("cache budget backoff skipped: %s", exc)
        return serve, info
    scaled = crashlog.scale_budget(full, plan.budget_factor)
    serve = replace(serve, cache_budget=CacheBudget.of_bytes(scaled))
    log.warning(
        "%d recent crash(es): expert cache budget backed off to %.0f%% (%d -> %d bytes)",
        plan.recent_crashes,
        100 * plan.budget_factor,
        full,
        scaled,
    )
    return serve, {**info, "budget_bytes_full": full, "budget_bytes": scaled}
