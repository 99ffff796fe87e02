"""Every model this daemon serves: one engine per model (its own thread, expert cache and prefix
cache), chosen by a request's `model`, loaded within one memory budget shared by all of them.

The transport thread owns this table. A model that does not fit beside the loaded ones unloads
the least recently used idle ones first (never a pinned one); a model that cannot fit even alone
is refused. An engine that fails is dropped alone: its own streams end with its error, the other
models keep serving (ARCHITECTURE.md, "Several models, one process").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moed.daemon.config import ServeConfig
from moed.daemon.engine.loop import Engine
from moed.daemon.engine.request import RequestKey
from moed.daemon.engine.status import EngineStatus
from moed.daemon.experts.budget import parse_size
from moed.daemon.experts.memory_plan import machine_memory, process_rss
from moed.daemon.model.cache_folder import model_cache_folder
from moed.daemon.model.footprint import model_footprint
from moed.daemon.model.limits import read_limits
from moed.daemon.model.servable import Catalog, Servable
from moed.daemon.model.source import ModelNotFound, ModelUnreadable
from moed.daemon.telemetry.per_model import ModelFigures
from moed.daemon.transport.admission import TokenCounter
from moed.daemon.transport.plan import ServerPlan
from moed.daemon.transport.progress import ProgressMonitor
from moed.protocol import ErrorCode, Limits, ProtocolError
from moed.protocol.units import format_bytes

log = logging.getLogger("moed.models")

EngineFactory = Callable[[ServeConfig, Servable, EngineStatus], Engine]


@dataclass
class ServedModel:
    """One servable model the daemon has been asked for, loaded or not."""

    servable: Servable
    serve: ServeConfig  # this model's settings: [serve] with its [models] entry over them
    engine: Engine
    status: EngineStatus
    limits: Limits
    tokens: TokenCounter
    progress: ProgressMonitor  # its own deadline: an idle model needs no progress
    last_used: float = field(default_factory=time.monotonic)
    streams: set[RequestKey] = field(default_factory=set)  # open on this model
    footprint: int | None = None  # bytes its memory plan holds, less the process's own
    loads_at_reserve: int | None = None  # a load decided, not yet seen done

    @property
    def name(self) -> str:
        return self.servable.name

    @property
    def loaded(self) -> bool:
        """Loaded, or a load decided and under way: what the budget counts."""
        if self.engine.loaded is not None:
            return True
        return self.loads_at_reserve is not None and self.status.get("loads") == (
            self.loads_at_reserve
        )

    def describe(self) -> dict[str, Any]:
        """`moe ps` and `/api/ps`: one loaded model."""
        snap = self.status.snapshot()
        since = snap.get("last_activity_at")
        return {
            "name": self.name,
            "path": str(self.servable.path),
            "state": snap["state"],
            "memory_bytes": self.footprint,
            "cache_budget": str(self.serve.cache_budget),
            "context_tokens": self.limits.context_tokens,
            "keep_alive_s": snap.get("keep_alive_s"),
            "idle_s": None if self.streams or since is None else round(time.time() - since, 1),
            "pinned": self.servable.pinned,
            "requests": len(self.streams),
            "requests_served": snap.get("requests_served"),
            "tokens_generated": snap.get("tokens_generated"),
            "loads": snap.get("loads"),
        }


class ModelSet:
    """The served models by canonical name; the started model is `started`."""

    def __init__(
        self,
        catalog: Catalog,
        plan: ServerPlan,
        started: Engine,
        status: EngineStatus,
        new_engine: EngineFactory,
    ):
        self.catalog = catalog
        serve = self.serve = plan.serve
        # Another model starts from [serve] as set, never from a started alias's own entry.
        self.base = plan.others or serve
        self._new_engine = new_engine
        self.capacity = _capacity(serve)
        self.started = self._served(catalog.started, serve, started, status)
        self.started.loads_at_reserve = 0  # preloaded at the start
        self._models: dict[str, ServedModel] = {self.started.name: self.started}
        self._of_stream: dict[RequestKey, ServedModel] = {}

    # ---- routing ---------------------------------------------------------------------------
    def route(self, name: str | None) -> ServedModel:
        """The served model a request names (made on first use, its engine not yet loading)."""
        try:
            servable = self.catalog.resolve(name)
        except ModelNotFound as exc:
            raise ProtocolError(ErrorCode.MODEL_NOT_FOUND, str(exc)) from None
        except ModelUnreadable as exc:
            raise ProtocolError(ErrorCode.MODEL_NOT_FOUND, f"model {name!r}: {exc}") from None
        model = self._models.get(servable.name)
        if model is None:
            serve = model_settings(self.base, servable)
            status = EngineStatus()
            engine = self._new_engine(serve, servable, status)
            model = self._models[servable.name] = self._served(servable, serve, engine, status)
            engine.start()
        return model

    def admit(self, model: ServedModel, key: RequestKey) -> None:
        """A request for `model` is admitted: room is made for it first if it is not loaded."""
        self.make_room(model)
        model.last_used = time.monotonic()
        model.streams.add(key)
        self._of_stream[key] = model

    def of_stream(self, key: RequestKey) -> ServedModel | None:
        return self._of_stream.get(key)

    def ended(self, key: RequestKey) -> None:
        model = self._of_stream.pop(key, None)
        if model is not None:
            model.streams.discard(key)
            model.last_used = time.monotonic()

    def models(self) -> list[ServedModel]:
        return list(self._models.values())

    def loaded_models(self) -> list[ServedModel]:
        return [m for m in self._models.values() if m.loaded]

    def figures(self) -> list[ModelFigures]:
        """Every model asked for, loaded or not, for `stats` and Prometheus (read off the
        transport thread too: the table is copied in one step)."""
        return [
            ModelFigures(
                m.name,
                m.status,
                m.engine.loaded and m.engine.loaded.streamer,
                len(m.streams),
                m.loaded,
            )
            for m in list(self._models.values())
        ]

    # ---- the memory budget -----------------------------------------------------------------
    def make_room(self, model: ServedModel) -> None:
        """Unload least recently used idle models until `model` fits beside the rest; refused
        when it cannot fit alone, or when what stands in its way is busy or pinned."""
        if model.loaded:
            return
        need = self.footprint(model)
        if need > self.capacity:
            raise ProtocolError(
                ErrorCode.MODEL_DOES_NOT_FIT,
                f"model {model.name!r} needs {format_bytes(need)}, more than the "
                f"{format_bytes(self.capacity)} the loaded models may hold together; give it "
                "a smaller budget or context in [models]",
            )
        others = [m for m in self._models.values() if m is not model and m.loaded]
        used = sum(self.footprint(m) for m in others)
        victims: list[ServedModel] = []
        for other in sorted(others, key=lambda m: m.last_used):
            if used + need <= self.capacity:
                break
            if not other.streams and not other.servable.pinned:
                victims.append(other)
                used -= self.footprint(other)
        if used + need > self.capacity:
            busy = [m.name for m in others if m not in victims]
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                f"model {model.name!r} does not fit beside {', '.join(busy)} (busy or pinned); "
                "retry once one of them is idle",
            )
        released = []
        for victim in victims:
            log.info("unloading %s to make room for %s", victim.name, model.name)
            victim.loads_at_reserve = None
            released.append(victim.engine.unload().done)
        if released:
            model.engine.await_room(tuple(released))
        model.loads_at_reserve = model.status.get("loads")

    def load(self, model: ServedModel) -> None:
        """`moe load`: make room and load it now, with no request waiting."""
        self.make_room(model)
        model.last_used = time.monotonic()
        model.engine.load()

    def unload(self, model: ServedModel) -> threading.Event:
        """`moe unload`: release it once idle (at once if it is)."""
        model.loads_at_reserve = None
        return model.engine.unload().done

    def footprint(self, model: ServedModel) -> int:
        """Bytes the model's memory plan holds beyond the process's own (planned once)."""
        if model.footprint is None:
            model.footprint = model_footprint(model.serve, model.servable.path, self.capacity)
        return model.footprint

    # ---- failures ----------------------------------------------------------------------------
    def failed(self) -> list[ServedModel]:
        """Models whose engine failed (its streams already ended with its error)."""
        return [m for m in self._models.values() if m.engine.fatal is not None]

    def drop(self, model: ServedModel) -> None:
        """Forget a failed model; the next request for it starts a fresh engine."""
        self._models.pop(model.name, None)
        for key in list(model.streams):
            self._of_stream.pop(key, None)
        if model is self.started:  # the started model comes back as a fresh, unloaded engine
            status = EngineStatus()
            engine = self._new_engine(model.serve, model.servable, status)
            self.started = self._served(model.servable, model.serve, engine, status)
            self._models[model.name] = self.started
            engine.start()

    def _served(
        self, servable: Servable, serve: ServeConfig, engine: Engine, status: EngineStatus
    ) -> ServedModel:
        limits = read_limits(serve, servable.path)
        tokens = TokenCounter(lambda: engine.loaded, servable.path)
        progress = ProgressMonitor(serve.progress_deadline_s)
        return ServedModel(servable, serve, engine, status, limits, tokens, progress)


def model_settings(serve: ServeConfig, servable: Servable, own_folder: bool = True) -> ServeConfig:
    """[serve]'s settings with the model's `[models]` entry over them. With `own_folder` (every
    model but the started one, which keeps the folder itself) its SSD prefix cache is a folder
    of its own under [serve]'s."""
    entry = servable.entry
    changes: dict[str, Any] = {"model": str(servable.path)}
    if own_folder:
        changes["prefix_cache_dir"] = str(
            model_cache_folder(serve.prefix_cache_folder, servable.name)
        )
    if entry is not None:
        changes["debug_faults"] = entry.debug_faults
        if entry.cache_budget is not None:
            changes["cache_budget"] = entry.cache_budget
        if entry.keep_alive is not None:
            changes["keep_alive"] = entry.keep_alive
        if entry.context is not None:
            changes["plan_context_tokens"] = entry.context
        if entry.prefix_cache_disk is not None:
            changes["prefix_cache_disk_bytes"] = entry.prefix_cache_disk
    return dataclasses.replace(serve, **changes)


def _capacity(serve: ServeConfig) -> int:
    """What the loaded models may hold together: the setting, or the machine's usable memory
    less what the process holds before any model (measured once, here)."""
    if serve.models_memory_bytes != "auto":
        return parse_size(serve.models_memory_bytes)
    usable = serve.memory_limit_bytes or machine_memory()[1]
    return max(0, usable - process_rss())
