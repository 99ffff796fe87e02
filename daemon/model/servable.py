"""What this daemon can serve by name: the model it started with, the `[models]` aliases, the
demo, any servable model in the local Hugging Face cache, and a folder named by its path.

A name resolves to one canonical entry (the name `moe ps` and `/api/ps` show), so that `demo`,
the demo's folder and its folder name all reach the same loaded model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moed.client.hub import cached_models
from moed.daemon.config import DEMO_MODEL, ModelEntry
from moed.daemon.model.source import ModelNotFound, ModelUnreadable, resolve_model
from moed.protocol.model_config import ModelConfig

log = logging.getLogger("moed.models")


@dataclass(frozen=True)
class Servable:
    """One model clients may name: what they call it, its folder, its `[models]` settings."""

    name: str
    path: Path
    entry: ModelEntry | None = None

    @property
    def pinned(self) -> bool:
        return self.entry is not None and self.entry.pin

    def describe(self) -> dict[str, Any]:
        """The listing's row (`/v1/models`, `/api/tags`): loaded or not, with its context."""
        try:
            context = ModelConfig.read(self.path).context_tokens
        except (OSError, ValueError):
            context = None
        return {"name": self.name, "path": str(self.path), "context_tokens": context}


class Catalog:
    """Resolves names to servable models; the started model comes first in every listing."""

    def __init__(self, started: str, started_path: Path, entries: tuple[ModelEntry, ...] = ()):
        self.started = Servable(started, started_path, _entry_for(entries, started))
        self._entries = {e.name: e for e in entries}
        self._aliases: dict[str, Servable] = {}
        self._by_path: dict[Path, Servable] = {started_path: self.started}

    def resolve(self, name: str | None) -> Servable:
        """The servable model a request names (None or empty: the started one); ModelNotFound
        lists what is servable, ModelUnreadable names the broken file."""
        try:
            return self._resolve(name)
        except ModelNotFound as exc:
            raise ModelNotFound(f"{exc}; servable here: {', '.join(self.names())}") from None

    def _resolve(self, name: str | None) -> Servable:
        if not name or name in (self.started.name, str(self.started.path)):
            return self.started
        if name in self._aliases:
            return self._aliases[name]
        entry = self._entries.get(name)
        try:
            path = resolve_model(entry.model if entry is not None else name)
        except ModelNotFound:
            found = [s for s in self._by_path.values() if s.path.name == name]
            if found:  # a known model's folder name, as `model` may say it today
                return found[0]
            raise
        if entry is not None:  # an alias is its own model: its own settings
            return self._aliases.setdefault(name, Servable(name, path, entry))
        return self._by_path.setdefault(path, Servable(name, path))

    def names(self) -> list[str]:
        return [s.name for s in self.listing()]

    def listing(self) -> list[Servable]:
        """Every model a request may name now, once each: started, aliases, demo, Hub cache."""
        out = [self.started]
        seen = {self.started.name, str(self.started.path)}
        for entry in self._entries.values():
            if entry.name not in seen:
                try:
                    out.append(self._resolve(entry.name))
                except (ModelNotFound, ModelUnreadable) as exc:  # listed in the log, not served
                    log.warning("[models] %s: %s", entry.name, exc)
                seen.add(entry.name)
        for name in [DEMO_MODEL, *_hub_names()]:
            if name not in seen:
                try:
                    servable = self._resolve(name)
                except (ModelNotFound, ModelUnreadable):
                    continue
                if servable.name not in seen and str(servable.path) not in seen:
                    out.append(servable)
                seen.add(name)
        return out


def _entry_for(entries: tuple[ModelEntry, ...], name: str) -> ModelEntry | None:
    return next((e for e in entries if e.name == name), None)


def _hub_names() -> list[str]:
    """The servable repos of the local Hugging Face cache (what `moe list` shows servable)."""
    try:
        return [m.repo_id for m in cached_models() if m.servable]
    except Exception as exc:  # a cache that cannot be scanned leaves the others listed
        log.warning("the Hugging Face cache could not be listed: %s", exc)
        return []
