"""The engine core: owns the MLX model and carries out what the scheduler decides, with no socket.

Commands come in through `handle`, work happens in `step` (admit what the scheduler says, then one
step of the running batch), events leave through an EventSink. The daemon runs it on its own thread
behind an inbox (engine/loop.py); tests drive it in-process.
"""

from __future__ import annotations

import logging
import queue
import time
from pathlib import Path

from moed.daemon.config import ServeConfig
from moed.daemon.engine.admission import start_generation
from moed.daemon.engine.batch import DecodeBatch, StepOutput
from moed.daemon.engine.commands import (
    Cancel,
    ClearPrefixCache,
    EngineCommand,
    GrammarReady,
    GrammarResult,
    OwnerHooks,
    Shed,
    Stop,
    Submit,
)
from moed.daemon.engine.failures import EngineFailures
from moed.daemon.engine.heartbeat import StepHeartbeat
from moed.daemon.engine.model_host import ModelHost, ModelLoadFailed
from moed.daemon.engine.prefix_feed import PrefixFeed
from moed.daemon.engine.recovery import InPlaceRecovery
from moed.daemon.engine.request import GenerateJob, Generation, RequestKey
from moed.daemon.engine.request_events import RequestEvents
from moed.daemon.engine.row_grammars import RowGrammars
from moed.daemon.engine.scheduler import BatchLimits, FairBatchScheduler, Scheduler
from moed.daemon.engine.sink import EventSink
from moed.daemon.engine.status import EngineStatus, ShedRecord
from moed.daemon.engine.step_abort import CancelBoard
from moed.daemon.engine.text_path import failure_of
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.ground.faults import Faults
from moed.daemon.model.loader import LoadedModel, LoadProgress
from moed.daemon.telemetry.request_trace import finish_request_trace
from moed.daemon.telemetry.trace import recording_all
from moed.protocol import ErrorCode, FinishReason, ProtocolError, ShedLevel

log = logging.getLogger("moed.engine")


class EngineCore:
    """Admits, steps, cancels and finishes generations; one thread calls every method. Holds the
    model host (load, unload, keep-alive), the prefix feed (what the prefix cache stores, when)
    and the request events (what each client is sent); its owner's hooks come typed."""

    def __init__(
        self,
        serve: ServeConfig,
        model_path: Path,
        sink: EventSink,
        status: EngineStatus,
        scheduler: Scheduler | None = None,
        owner: OwnerHooks | None = None,
        faults: Faults | None = None,
        cancels: CancelBoard | None = None,
    ):
        self.serve = serve
        self.sink = sink
        self.status = status
        self.scheduler = scheduler or FairBatchScheduler(
            BatchLimits(serve.max_batch, serve.plan_context_tokens, serve.batch_window_ms / 1000.0)
        )
        self.owner = owner or OwnerHooks()
        self._gens: dict[RequestKey, Generation] = {}
        self._rows: dict[int, Generation] = {}  # batch row id -> its request
        self.batch: DecodeBatch | None = None
        self.fatal: BaseException | None = None
        self.exit_code: int = DaemonExit.FAILED  # what the process exits with once `fatal` is set
        # Off unless debug_faults says otherwise; a bad spec is a configuration error at the edge.
        self.faults = faults if faults is not None else Faults.parse(serve.debug_faults)
        self.heartbeat = StepHeartbeat(status, self.faults)  # progress inside a step
        self.cancels = cancels if cancels is not None else CancelBoard()
        self.failures = EngineFailures(self)  # a step's rows, or the process (failures.py)
        self.heartbeat.abandon = self.failures.only_cancelled_rows
        self.host = ModelHost(serve, model_path, status, self.heartbeat, self.faults)
        # A pipeline's other ranks free their layers of the entries cleared.
        self.prefix = PrefixFeed(serve, status, lambda: self.host.refresh_ranks(force=True))
        self.events = RequestEvents(sink, status, self.host)
        self.in_place = InPlaceRecovery(self, serve)  # device failures inside a step
        # Grammars built on the pool's threads: the owner's inbox, or a queue each step reads.
        self._posted: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self.grammars = RowGrammars(serve, self.owner.post or self._posted.put)

    @property
    def has_work(self) -> bool:
        return bool(self._gens)

    @property
    def loaded(self) -> LoadedModel | None:
        return self.host.loaded

    def idle_for(self) -> float | None:
        """How long the owner may block waiting for commands: 0 while the batch has rows, the
        scheduler's gathering wait while requests wait, None (until a command) when idle."""
        if (self.batch is not None and self.batch.rows) or self.scheduler.running:
            return 0.0
        # Nothing ready to join (or nothing at all): the next command (a grammar built, a new
        # request) wakes the owner.
        return self.scheduler.wake_in(time.monotonic()) if self._gens else None

    def finish_all(self, code: ErrorCode, message: str) -> None:
        """End every active request with `code` (the drain at shutdown)."""
        for gen in list(self._gens.values()):
            self._finish(gen, code, message)

    # ---- commands --------------------------------------------------------------------------
    def handle(self, command: EngineCommand) -> None:
        if isinstance(command, Submit):
            self._admit(command.job)
        elif isinstance(command, Cancel):
            self.cancels.discard(command.key)
            if (gen := self._gens.get(command.key)) is not None:  # else it already ended
                self._finish(gen, FinishReason.CANCELLED)
        elif isinstance(command, Shed):
            self._shed(command.level)
        elif isinstance(command, GrammarReady):
            self._grammar_ready(command.key, command.result)
        elif isinstance(command, ClearPrefixCache):
            log.warning("prefix cache cleared: %s", self.prefix.clear())
        elif not isinstance(command, Stop):  # Stop only wakes the owner's loop
            raise TypeError(f"not an engine command: {command!r}")

    # ---- work ------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit what the scheduler says, then one step of the running batch."""
        while not self._posted.empty():  # driven in-process: the grammars built meanwhile
            self.handle(self._posted.get())
        self.prefix.store_due(self._rows)  # rows ended by a command (a cancel) since the last step
        wait = self.in_place.recovering  # a recovery's rows catch up: new requests wait for memory
        admitted = () if wait else self.scheduler.schedule(time.monotonic()).admit
        for key in admitted:
            self._join(self._gens[key])
        if admitted:  # a row that joined reads its prompt: the SSD tier holds its writes now
            self.prefix.gate(self._rows.values())
        if self.batch is None or not self.batch.rows:
            self.host.sync_group()
            return
        try:
            if self.faults:
                self.faults.before_step(self.status.get("tokens_generated"))
            traced = [g.trace for g in self._rows.values() if g.trace is not None]
            with recording_all(traced):
                out = self.batch.step()
        except Exception as exc:  # a step stopped at a layer (StepAborted) or failed
            self.failures.step_failed(exc)
            return
        self._deliver(out)
        self.prefix.store_due(self._rows)
        self.prefix.gate(self._rows.values())

    def _admit(self, job: GenerateJob) -> None:
        if self.loaded is None and not self._reload_for(job):
            return
        gen = start_generation(job, self.host, self.serve, self.faults, self.events)
        if gen is None:  # refused, or failed to start: its client was told why
            return
        self._gens[job.key] = gen
        # A request with a grammar holds its place while a pool thread builds it (GrammarReady).
        ready = not self.grammars.start(gen)
        self.scheduler.add(job.key, gen.client, gen.kv_tokens, time.monotonic(), ready)
        if job.request.progress:  # at once, before a batch row is free: a first byte
            self.events.prompt_progress(gen, 0, len(gen.context))
        self.host.admitted(job.request.keep_alive)
        self._publish_counts()

    def _grammar_ready(self, key: RequestKey, result: GrammarResult) -> None:
        """A waiting request's grammar is built: it may join the batch, or its refusal ends it."""
        self.status.update(grammars=self.grammars.stats())
        gen = self._gens.get(key)
        if gen is None:  # it ended (a cancel) while its grammar was built
            return
        if isinstance(result, ProtocolError):
            self._forget(key)
            finish_request_trace(gen.trace)
            self.events.refuse(gen.job, result)
            return
        gen.constraint = result
        self.scheduler.ready(key)

    def _join(self, gen: Generation) -> None:
        """A request takes its row: its context is queued for prefill in the next steps."""
        gen.started = time.perf_counter()
        hit, marks = self.prefix.lookup(gen.context, gen.cache_scope)
        gen.cached_tokens = hit.length if hit is not None else 0
        assert self.batch is not None  # rows join the batch of a loaded model
        scope = gen.cache_scope
        gen.uid = self.batch.insert(
            gen.context, gen.max_new_tokens, gen.sampler, gen.constraint, hit, marks, scope
        )
        self._rows[gen.uid] = gen
        self._publish_counts()
        if len(self._rows) > self.status.get("peak_running_requests"):
            self.status.update(peak_running_requests=len(self._rows))

    # ---- the model host --------------------------------------------------------------------
    def load(self, on_progress: LoadProgress | None = None) -> bool:
        """Load the model; False (with `fatal` set and status `failed`) when it cannot load."""
        started = time.perf_counter()
        try:
            loaded = self.host.load(on_progress)
        except (ModelLoadFailed, RuntimeError) as exc:  # RuntimeError: a pipeline rank failed
            self.failures.load_failed(exc)
            return False
        self.prefix.open(loaded, self.host.model_path)
        self.batch = self._new_batch()
        self.host.ready(started)
        return True

    def _new_batch(self) -> DecodeBatch:
        return self.host.new_batch(self.prefix.cache, self.in_place.chunk_limit)

    def _reload_for(self, job: GenerateJob) -> bool:
        """Load again for a request that arrived while idle; it sees `progress` messages."""
        self.status.update(busy=True)  # a request waits on this load: the watchdog watches it
        loaded = self.load(self.events.load_progress(job))
        self.status.update(busy=bool(self._gens))
        if loaded:
            return True
        message = f"the model failed to load again: {self.fatal}"
        self.events.reject(job, ErrorCode.INTERNAL, message)
        return False

    def maybe_unload(self) -> None:
        """Release the model and the expert cache once the keep-alive of an idle engine expired."""
        if not self._gens and self.host.unload_due():
            self.unload()

    def unload(self) -> None:
        """Release the model and the expert cache (state `idle`); the next request reloads them."""
        self.close()  # saves the usage profile (the reload warms from it), closes the streamer
        self.host.release()

    def close(self) -> None:
        self.prefix.store_due(self._rows)  # what ended last (a drain) reaches the tiers first
        self.grammars.close()  # an unload too: a reload starts another pool at need
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        self.prefix.close()
        self.host.close(self.exit_code)

    def _deliver(self, out: StepOutput) -> None:
        if out.prompts:  # a long prefill yields no token for a while: the watchdog sees progress
            self.status.update(last_progress_at=time.time())
        for chunk in out.prompts:  # clients see a long prompt move, chunk by chunk
            if chunk.uid in self.in_place.catching_up:  # a recovery reads it again: nothing new
                continue
            if (gen := self._rows.get(chunk.uid)) is not None:
                self.events.prompt_read(gen, chunk.done, chunk.total)
        for row in out.saved:
            self.prefix.keep(row)
        for tok in out.tokens:
            gen = self._rows.get(tok.uid)
            if gen is None:  # cancelled while its token was being computed
                continue
            self.in_place.row_moved(tok.uid)
            if gen.first_token_at is None:
                gen.first_token_at = time.perf_counter()
            if gen.constraint is not None and gen.constraint.failure is not None:
                self.failures.row_failed(gen, gen.constraint.failure)  # before a token it refused
                continue
            if tok.finish is FinishReason.STOP:  # end of sequence: the EOS token is not text
                self._finish(gen, FinishReason.STOP)
                continue
            try:
                stopped = self.events.token(gen, tok.token, tok.logprobs)
            except Exception as exc:  # this row's own text path: it fails alone
                self.failures.row_failed(gen, exc)
                continue
            if stopped:
                self._finish(gen, FinishReason.STOP)  # a stop sequence matched
            elif tok.finish is not None:
                self._finish(gen, tok.finish)

    # ---- endings -----------------------------------------------------------------------------
    def _forget(self, key: RequestKey, keep: bool = False) -> None:
        gen = self._gens.pop(key, None)
        self.scheduler.remove(key)
        if gen is not None and gen.wants_grammar:
            self.grammars.cancel(key)
        if gen is not None and gen.uid is not None:
            self._rows.pop(gen.uid, None)
            self.in_place.row_moved(gen.uid)
            if self.batch is not None:
                # A no-op for a row that finished by itself; with `keep`, its caches are cached.
                keep = keep and self.prefix.cache is not None
                self.prefix.keep(self.batch.remove(gen.uid, keep=keep))
        # Published before the terminal message, so a client that saw `done` sees the count drop.
        self._publish_counts()
        self.prefix.gate(self._rows.values())
        if not self._gens:
            self.host.keep_alive.became_idle()
            self.status.update(last_activity_at=time.time())

    def _publish_counts(self) -> None:
        self.status.update(
            active_requests=len(self._gens),
            running_requests=len(self._rows),
            busy=bool(self._gens),
        )

    def _finish(
        self,
        gen: Generation,
        reason: FinishReason | ErrorCode,
        message: str = "the daemon is shutting down",
    ) -> None:
        self._forget(gen.job.key, keep=not isinstance(reason, ErrorCode))
        finish_request_trace(gen.trace)  # its last chunk goes out before the terminal message
        if not isinstance(reason, ErrorCode):
            try:  # the text held back: a call left open by max_tokens or a cancel is dropped
                tail = gen.final_text(cut=reason is not FinishReason.STOP)
                if tail.segments or tail.tool_calls:
                    self.events.segments(gen, [], tail)
            except Exception as exc:  # this row's own text path: it fails alone
                log.warning("request %r failed alone: %s", gen.job.request_id, exc, exc_info=exc)
                reason, message = failure_of(exc)
        if isinstance(reason, ErrorCode):
            self.status.add(requests_failed=1)
            self.events.failed(gen, reason, message)
            return
        self.status.add(requests_served=1)
        self.events.done(gen, reason)

    def _shed(self, level: ShedLevel) -> None:
        # Cached prefixes go first: no request loses anything.
        released = self.prefix.shed() + self.host.shed()
        log.warning("shed level=%s released=%d bytes", level.value, released)
        cancelled = None
        newest = self.scheduler.newest()
        if level is ShedLevel.CANCEL_NEWEST and newest is not None:
            gen = self._gens[newest]
            cancelled = gen.job.request_id
            self._finish(
                gen,
                ErrorCode.OUT_OF_MEMORY,
                "cancelled to relieve memory pressure (the newest request is shed first)",
            )
        self.status.add(sheds=1)
        self.status.update(last_shed=ShedRecord(level.value, time.time(), released, cancelled))
