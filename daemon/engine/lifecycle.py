"""The engine core's model lifecycle: load (with progress), the running batch it serves, idle
unload and reload on demand, close; and the status that comes from the loaded model (streaming
snapshot, the pipeline ranks). A mixin of EngineCore, split out to keep one concern per module."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from moed.daemon.config import ServeConfig
from moed.daemon.distributed.failure import outside_a_step
from moed.daemon.distributed.rank0 import load_leader
from moed.daemon.engine.batch import DecodeBatch
from moed.daemon.engine.chunk_budget import ChunkBudget, chunk_budget
from moed.daemon.engine.heartbeat import StepHeartbeat
from moed.daemon.engine.idle import KeepAlive
from moed.daemon.engine.prefix_cache.cache import PrefixCache
from moed.daemon.engine.prefix_cache.setup import open_prefix_cache
from moed.daemon.engine.request import GenerateJob, Generation, RequestKey
from moed.daemon.engine.sink import EventSink
from moed.daemon.engine.status import DaemonState, EngineStatus
from moed.daemon.experts.active_experts import ActiveExpertsError
from moed.daemon.experts.hooks import EngineHooks
from moed.daemon.ground.crashlog import CrashKind
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.ground.faults import Faults
from moed.daemon.model.layer_progress import watch_layers
from moed.daemon.model.loader import (
    CheckpointUnusable,
    LoadedModel,
    LoadProgress,
    MemoryPlanRefused,
    describe_model,
    load_model,
)
from moed.protocol import ErrorCode
from moed.protocol.events import LoadProgress as LoadProgressEvent  # the loader's is a callback

if TYPE_CHECKING:
    import mlx.nn as nn

log = logging.getLogger("moed.engine")

RANKS_REFRESH_S = 1.0


class ModelLifecycle:
    """Load, unload, reload and close the model of an EngineCore (whose __init__ sets the state)."""

    # The engine core's state this mixin reads and sets (EngineCore.__init__ gives each a value).
    serve: ServeConfig
    model_path: Path
    sink: EventSink
    status: EngineStatus
    heartbeat: StepHeartbeat
    keep_alive: KeepAlive
    loaded: LoadedModel | None
    batch: DecodeBatch | None
    prefix_cache: PrefixCache | None
    fatal: BaseException | None
    exit_code: int
    faults: Faults
    chunk_limit: int | None  # the prompt chunk's ceiling a recovery in place set
    _gens: dict[RequestKey, Generation]
    _ranks_at: float
    # ... and what the engine core does for it (engine/core.py).
    reject_queued: Callable[[ErrorCode, str], None]
    reject: Callable[[GenerateJob, ErrorCode, str], None]
    _record_crash: Callable[[CrashKind, str], None]
    _group_failed: Callable[[BaseException], None]

    def load(self, on_progress: LoadProgress | None = None) -> bool:
        """Load the model; False (with `fatal` set and status `failed`) when it cannot load."""
        t0 = time.perf_counter()
        mode = "resident" if self.serve.resident else f"streaming, budget {self.serve.cache_budget}"
        log.info("loading %s (%s)", self.model_path, mode)
        self.status.update(state=DaemonState.LOADING)

        def progress(stage: str, done: float, total: float, unit: str) -> None:
            # A load step is progress: the watchdog's wedge rule sees a reload move.
            self.status.update(
                load={"stage": stage, "done": done, "total": total, "unit": unit},
                last_progress_at=time.time(),
            )
            if on_progress is not None:
                on_progress(stage, done, total, unit)

        try:
            self.loaded = self._load_model(progress)
        except BaseException as exc:  # a model that cannot load is fatal for the daemon
            log.exception("model load failed")
            self._record_crash(CrashKind.LOAD_FAILED, f"{exc.__class__.__name__}: {exc}")
            if isinstance(exc, MemoryPlanRefused):
                self.exit_code = DaemonExit.DOES_NOT_FIT
            elif isinstance(exc, CheckpointUnusable):
                self.exit_code = DaemonExit.MODEL_UNUSABLE
            elif isinstance(exc, ActiveExpertsError):  # a setting the model cannot take
                self.exit_code = DaemonExit.CONFIG
            self.status.update(state=DaemonState.FAILED, error=f"{exc.__class__.__name__}: {exc}")
            self.reject_queued(ErrorCode.INTERNAL, f"model failed to load: {exc}")
            self.fatal = exc
            return False
        try:
            self._refresh_ranks(force=True)  # before READY: a ready pipeline lists its ranks
        except RuntimeError as exc:  # a rank failed while loading; the group monitor says which
            self._group_failed(exc)
            return False
        self._watch_progress()
        self._open_prefix_cache()
        self.batch = self._new_batch()
        self.status.add(loads=1)
        self.status.update(
            state=DaemonState.READY,
            model=describe_model(self.loaded),
            load_s=round(time.perf_counter() - t0, 3),
            streaming=self._stream_snapshot(),
            memory_plan=self.loaded.streamer.plan.describe() if self.loaded.streamer else None,
            last_activity_at=time.time(),
        )
        self.keep_alive.became_idle()
        log.info("model loaded from %s in %.2fs", self.model_path, time.perf_counter() - t0)
        return True

    def _load_model(self, progress: LoadProgress) -> LoadedModel:
        """The load choice: rank 0 of a pipeline loads its own layers (the group follows); a
        daemon alone loads the whole model."""
        if not self.serve.pipelined:
            return load_model(self.serve, self.model_path, progress)
        if self.serve.max_active_experts:
            raise ActiveExpertsError("max_active_experts is not supported with a pipeline yet")
        return load_leader(self.serve, self.model_path)

    def _watch_progress(self) -> None:
        """Every layer of a prompt chunk and every expert read is progress (engine/heartbeat.py).
        A pipeline's leader runs the other ranks' layers through collectives: its chunks are
        watched per step, as before."""
        assert self.loaded is not None  # called once a model is loaded
        if self.loaded.pipeline is not None:
            return
        watch_layers(self.loaded.model, self.heartbeat.layer_done)
        if self.loaded.streamer is not None:
            # Tests raise device failures at the sync points.
            on_sync = self.faults.at if self.faults.device else None
            self.loaded.streamer.attach(EngineHooks(self.heartbeat.beat, on_sync))

    def _new_batch(self) -> DecodeBatch:
        # A pipeline's leader mirrors every batch-cache change to the other ranks (cache_ops.py).
        assert self.loaded is not None  # called once a model is loaded
        eos = getattr(self.loaded.tokenizer, "eos_token_ids", None) or []
        trimmable = self.prefix_cache.trimmable if self.prefix_cache is not None else None
        # Only a model held whole here: a pipeline's last layer may sit on another rank.
        streamer = self.loaded.streamer if self.loaded.pipeline is None else None
        return DecodeBatch(
            # A pipeline's leader stands in for the model: it is called like one (mlx-lm types
            # BatchGenerator's model as nn.Module).
            cast("nn.Module", self.loaded.model),
            eos,
            self.serve.max_batch,
            self.serve.prefill_chunk,
            lone_chunk_budget(self.loaded, self.serve),
            trimmable,
            streamer.unused_output.scope if streamer is not None else nullcontext,
            streamer.prompt_end_step if streamer is not None else None,
            self.prefix_cache.decode_ladder() if self.prefix_cache is not None else None,
            self.chunk_limit,
            self.faults.at if self.faults.device else None,
        )

    def _open_prefix_cache(self) -> None:
        assert self.loaded is not None  # called once a model is loaded
        if self.prefix_cache is None:
            try:
                self.prefix_cache = open_prefix_cache(self.serve, self.loaded, self.model_path)
            except Exception:  # advisory: the daemon serves without it
                log.exception("the prefix cache could not start; serving without it")
            if self.prefix_cache is not None and self.prefix_cache.disk is not None:
                # Counters read from the writer thread: plain values the engine only replaces.
                self.prefix_cache.disk.on_written = self._publish_prefix_cache
        self._publish_prefix_cache()

    def _publish_prefix_cache(self) -> None:
        cache = self.prefix_cache
        self.status.update(
            prefix_cache=cache.snapshot() if cache is not None else None,
            prefix_entries=cache.entries() if cache is not None else None,
        )

    def maybe_unload(self) -> None:
        """Release the model and the expert cache once the keep-alive of an idle engine expired."""
        if self.loaded is not None and not self._gens and self.keep_alive.due():
            log.info(
                "idle for %.0fs: releasing the model and the expert cache",
                self.keep_alive.current_s,
            )
            self.unload()

    def unload(self) -> None:
        """Release the model and the expert cache (state `idle`); the next request reloads them."""
        self.close()  # saves the usage profile (the reload warms from it), closes the streamer
        self.loaded = None
        self.keep_alive.idle_since = None
        gc.collect()  # the model graph holds reference cycles
        mx.clear_cache()  # hand MLX's freed buffers back to the system
        self.status.update(state=DaemonState.IDLE, streaming=None)
        self.status.add(unloads=1)

    def _reload_for(self, job: GenerateJob) -> bool:
        """Load again for a request that arrived while idle; it sees `progress` messages."""

        def progress(stage: str, done: float, total: float, unit: str) -> None:
            event = LoadProgressEvent(stage, done, total, unit)
            self.sink.emit(job.identity, job.request_id, event)

        self.status.update(busy=True)  # a request waits on this load: the watchdog watches it
        loaded = self.load(progress)
        self.status.update(busy=bool(self._gens))
        if loaded:
            return True
        self.reject(job, ErrorCode.INTERNAL, f"the model failed to load again: {self.fatal}")
        return False

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        if self.prefix_cache is not None:
            self.prefix_cache.close()  # the SSD tier's pending writes land first
            self.prefix_cache = None
            self._publish_prefix_cache()
        pipeline = self.loaded.pipeline if self.loaded else None
        if pipeline is not None and self.exit_code != DaemonExit.RANK_FAILED:
            try:
                pipeline.shutdown()  # the other ranks leave their loops and exit
            except RuntimeError:
                log.warning("the pipeline group was already broken at shutdown")
        streamer = self.loaded.streamer if self.loaded else None
        if streamer is None:
            return
        try:
            streamer.save_profile()
        except OSError:
            log.exception("could not save the expert-usage profile")
        streamer.close()

    def _sync_group(self) -> None:
        """An idle pipeline carries the cache ops recorded since its last step (the SSD tier's
        writes and removals) to the followers now, not with the next request."""
        pipeline = self.loaded.pipeline if self.loaded else None
        if pipeline is not None and pipeline.ops_pending:
            outside_a_step("sync", pipeline.sync, log)

    def _refresh_ranks(self, force: bool = False) -> None:
        """Every rank's status into `status.ranks` (collectives: on the engine thread only, and
        at most once a second)."""
        pipeline = self.loaded.pipeline if self.loaded else None
        now = time.monotonic()
        if pipeline is None or (not force and now - self._ranks_at < RANKS_REFRESH_S):
            return
        self._ranks_at = now
        ranks = outside_a_step("status", pipeline.status, log)  # a telemetry's or a `done`'s
        if ranks is not None:
            self.status.update(ranks=ranks)

    def _stream_snapshot(self) -> dict[str, Any] | None:
        if self.loaded is None or self.loaded.streamer is None:
            return None
        snapshot: dict[str, Any] = self.loaded.streamer.snapshot()
        return snapshot


def lone_chunk_budget(loaded: LoadedModel, serve: ServeConfig) -> ChunkBudget | None:
    """A lone streamed prompt's chunk bound from the memory plan: its working memory and its KV
    room. Only streaming grows the chunk (each chunk reads its experts once, so the bytes per
    token fall with it); a resident model reads nothing (the demo model's 875-token first turn
    in one pass took 0.78 s on this CPU, in 256-token ones 0.59 s): it keeps `prefill_chunk`,
    as does a pipeline's leader (its ranks hold the activations)."""
    if loaded.pipeline is not None or loaded.streamer is None:
        return None
    working = loaded.streamer.plan.working_bytes
    dtype_bytes = 4 if loaded.config.torch_dtype == "float32" else 2
    return chunk_budget(
        loaded.config, working, serve.plan_context_tokens, serve.prefill_chunk, dtype_bytes
    )
