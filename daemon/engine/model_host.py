"""The model host: the model an engine serves and its residency. Load (with progress), idle
unload by keep-alive and reload on demand, close; the batch a loaded model runs; and the status
that comes from the loaded model (streaming snapshot, the pipeline ranks). The engine core holds
one; what a failed load means for the requests is the core's (engine/failures.py)."""

from __future__ import annotations

import gc
import logging
import time
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
from moed.daemon.engine.status import DaemonState, EngineStatus
from moed.daemon.experts.active_experts import ActiveExpertsError
from moed.daemon.experts.hooks import EngineHooks
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
from moed.protocol.units import KeepAliveDuration

if TYPE_CHECKING:
    import mlx.nn as nn

log = logging.getLogger("moed.engine")

RANKS_REFRESH_S = 1.0


class ModelLoadFailed(Exception):
    """The model could not load: the cause, and the code the process exits with."""

    def __init__(self, cause: BaseException, exit_code: int):
        super().__init__(f"{cause.__class__.__name__}: {cause}")
        self.cause = cause
        self.exit_code = exit_code


class ModelHost:
    """Loads, holds and releases the model of one engine; called on the engine thread only."""

    def __init__(
        self,
        serve: ServeConfig,
        model_path: Path,
        status: EngineStatus,
        heartbeat: StepHeartbeat,
        faults: Faults,
    ):
        self.serve = serve
        self.model_path = model_path
        self.status = status
        self.heartbeat = heartbeat
        self.faults = faults
        self.loaded: LoadedModel | None = None
        # A pipeline's other ranks hold their layers for the group's life: only one process unloads.
        self.keep_alive = KeepAlive(None if serve.pipelined else serve.keep_alive_s)
        self.status.update(keep_alive_s=self.keep_alive.seconds)
        self._ranks_at = 0.0  # when the pipeline ranks' status was last gathered

    def load(self, on_progress: LoadProgress | None = None) -> LoadedModel:
        """Load the model (status `loading`, each step published as progress). Raises
        ModelLoadFailed when it cannot load, RuntimeError when a pipeline rank failed meanwhile."""
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
            raise ModelLoadFailed(exc, _exit_for_load(exc)) from exc
        self.refresh_ranks(force=True)  # before READY: a ready pipeline lists its ranks
        self._watch_progress()
        return self.loaded

    def ready(self, started: float) -> None:
        """Say `ready` once the engine built its batch (`started`: the load's perf_counter)."""
        assert self.loaded is not None  # called once a model is loaded
        self.status.add(loads=1)
        self.status.update(
            state=DaemonState.READY,
            model=describe_model(self.loaded),
            load_s=round(time.perf_counter() - started, 3),
            streaming=self.stream_snapshot(),
            memory_plan=self.loaded.streamer.plan.describe() if self.loaded.streamer else None,
            last_activity_at=time.time(),
        )
        self.keep_alive.became_idle()
        log.info("model loaded from %s in %.2fs", self.model_path, time.perf_counter() - started)

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

    def new_batch(self, prefix: PrefixCache | None, chunk_limit: int | None) -> DecodeBatch:
        """A running batch over the loaded model (`chunk_limit`: a recovery's prompt ceiling)."""
        # A pipeline's leader mirrors every batch-cache change to the other ranks (cache_ops.py).
        assert self.loaded is not None  # called once a model is loaded
        eos = getattr(self.loaded.tokenizer, "eos_token_ids", None) or []
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
            prefix.trimmable if prefix is not None else None,
            streamer.steps.unused_output if streamer is not None else nullcontext,
            streamer.steps.prompt_end if streamer is not None else None,
            prefix.decode_ladder() if prefix is not None else None,
            chunk_limit,
            self.faults.at if self.faults.device else None,
        )

    # ---- keep-alive ------------------------------------------------------------------------
    def admitted(self, keep_alive: KeepAliveDuration | None) -> None:
        """A request started: nothing unloads while it runs; its keep-alive applies after it."""
        self.keep_alive.admitted(keep_alive)
        self.status.update(keep_alive_s=self.keep_alive.seconds)

    def unload_when_idle(self) -> None:
        """An unload asked while requests run: the model goes as soon as the engine is idle."""
        self.keep_alive.current_s = 0.0

    def unload_due(self) -> bool:
        """Whether a loaded, idle engine's keep-alive expired."""
        if self.loaded is None or not self.keep_alive.due():
            return False
        log.info(
            "idle for %.0fs: releasing the model and the expert cache", self.keep_alive.current_s
        )
        return True

    # ---- release ---------------------------------------------------------------------------
    def close(self, exit_code: int) -> None:
        """The pipeline's other ranks leave (unless they failed), the usage profile is saved (a
        reload warms from it) and the streamer closes; the model stays referenced."""
        pipeline = self.loaded.pipeline if self.loaded else None
        if pipeline is not None and exit_code != DaemonExit.RANK_FAILED:
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

    def release(self) -> None:
        """After `close`: drop the model and its memory (state `idle`); the next request loads."""
        self.loaded = None
        self.keep_alive.idle_since = None
        gc.collect()  # the model graph holds reference cycles
        mx.clear_cache()  # hand MLX's freed buffers back to the system
        self.status.update(state=DaemonState.IDLE, streaming=None)
        self.status.add(unloads=1)

    def shed(self) -> int:
        """Memory pressure: half of the expert cache (each rank its own) and MLX's free buffers;
        the bytes given back here."""
        released = 0
        if self.loaded is not None and self.loaded.streamer is not None:
            released += self.loaded.streamer.shed(0.5)
        if self.loaded is not None and self.loaded.pipeline is not None:
            self.loaded.pipeline.shed(0.5)  # every rank sheds its own cache
        mx.clear_cache()
        return released

    # ---- what the loaded model reports -----------------------------------------------------
    def sync_group(self) -> None:
        """An idle pipeline carries the cache ops recorded since its last step (the SSD tier's
        writes and removals) to the followers now, not with the next request."""
        pipeline = self.loaded.pipeline if self.loaded else None
        if pipeline is not None and pipeline.ops_pending:
            outside_a_step("sync", pipeline.sync, log)

    def refresh_ranks(self, force: bool = False) -> None:
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

    def stream_snapshot(self) -> dict[str, Any] | None:
        if self.loaded is None or self.loaded.streamer is None:
            return None
        snapshot: dict[str, Any] = self.loaded.streamer.snapshot()
        return snapshot


def _exit_for_load(exc: BaseException) -> int:
    """The exit code of a load that failed: the service manager tells these apart."""
    if isinstance(exc, MemoryPlanRefused):
        return DaemonExit.DOES_NOT_FIT
    if isinstance(exc, CheckpointUnusable):
        return DaemonExit.MODEL_UNUSABLE
    if isinstance(exc, ActiveExpertsError):  # a setting the model cannot take
        return DaemonExit.CONFIG
    return DaemonExit.FAILED


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
