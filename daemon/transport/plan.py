"""What the transport starts with, decided before it exists (runtime/start_plan.py builds it): the
settings to serve with and what the crash record says."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moed.daemon.config import ModelEntry, ServeConfig
from moed.daemon.ground.crashlog import StartPlan


@dataclass(frozen=True)
class ServerPlan:
    serve: ServeConfig  # final: the cache budget already backed off after recent crashes
    model_path: Path
    crashes: StartPlan  # refuse to start, poison requests, the last crash (welcome and status)
    budget_backoff: dict[str, Any] | None = (
        None  # how the budget was backed off, for status and crashes
    )
    models: tuple[ModelEntry, ...] = ()  # the config file's [models] aliases
    # [serve] as set, before a started alias's [models] entry: what the other models start from
    # (None: `serve`, the started model is no alias)
    others: ServeConfig | None = None
