"""The engine: one thread that owns the MLX model and steps every active generation in turn.

It never touches the client socket: requests arrive on a queue, events leave through an EventSink
(an inproc ZMQ PUSH the transport thread drains). The same engine runs in-process in tests.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from moed.protocol import ErrorCode, FinishReason, ProtocolError, ShedLevel
from moed.protocol import messages as wire

from .config import ServeConfig
from .experts.telemetry import CUMULATIVE_KEYS
from .exit_codes import DaemonExit
from .status import DaemonState, EngineStatus
from .telemetry.trace import finish_request_trace, recording, start_request_trace
from .watchdog.crashlog import CrashKind, is_out_of_memory
from .watchdog.faults import Faults

log = logging.getLogger("moed.engine")

RequestKey = tuple[bytes, Any]  # (client identity, client-chosen request id)


class EventSink(Protocol):
    def emit(self, identity: bytes, msg: dict, terminal: bool = False) -> None: ...


@dataclass
class GenerateJob:
    identity: bytes
    request: dict  # a validated `generate` message
    received_at: float = field(default_factory=time.perf_counter)

    @property
    def key(self) -> RequestKey:
        return (self.identity, self.request["id"])


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    config: dict
    streamer: Any  # ExpertStreamer or None when resident


def load_model(serve: ServeConfig, path: Path) -> LoadedModel:
    """Load lazily, swap in the streaming experts, then materialize only what stays resident."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tokenizer, config = load(str(path), lazy=True, return_config=True)
    streamer = None
    if not serve.resident:
        from .experts import install_streaming

        streamer = install_streaming(model, path, streaming_config(serve, config))
        if not streamer.plan.fits:
            streamer.close()
            raise MemoryPlanRefused(streamer.plan.refusal())
    mx.eval(model.parameters())
    if streamer is not None:
        warmed = streamer.warm()  # the experts the saved usage profile found hot
        log.info("expert cache warmed with %d bytes from the usage profile", warmed)
    return LoadedModel(model, tokenizer, path, config, streamer)


def streaming_config(serve: ServeConfig, model_config: dict):
    """The expert-streaming settings of a daemon configuration, with room for its KV cache."""
    from .experts import StreamingConfig, estimate_kv_bytes

    return StreamingConfig(
        cache_budget=serve.cache_budget,
        prefetch_workers=serve.prefetch_workers,
        page_cache=serve.page_cache,
        state_dir=serve.state_dir,
        prefetch_next=serve.prefetch_next,
        memory_bytes=serve.memory_limit_bytes,
        kv_bytes=estimate_kv_bytes(model_config, serve.plan_context_tokens),
    )


class MemoryPlanRefused(RuntimeError):
    """The memory plan says the model cannot fit: refuse before it can crash the process."""



def counters_delta(before: dict | None, after: dict | None) -> dict:
    """Per-request telemetry: numeric counters as differences, everything else as the latest value."""
    if not after:
        return {}
    before = before or {}
    out: dict[str, Any] = {}
    for name, value in after.items():
        prior = before.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(prior, (int, float)):
            out[name] = value - prior if name in CUMULATIVE_KEYS else value
        else:
            out[name] = value
    return out




class Generation:
    """One request's decoding state: its own KV cache, sampler and detokenizer."""

    def __init__(self, job: GenerateJob, loaded: LoadedModel, serve: ServeConfig, stream_snapshot: dict | None,
                 on_progress: Callable[[], None] | None = None):
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        from .sampling import SamplingParams, make_position_sampler

        req = job.request
        self.job = job
        self.tokenizer = loaded.tokenizer
        prompt_ids = tokenize_prompt(loaded.tokenizer, req)
        if len(prompt_ids) > serve.max_prompt_tokens:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt is {len(prompt_ids)} tokens; this daemon accepts at most {serve.max_prompt_tokens}",
            )
        max_tokens = min(req.get("max_tokens") or serve.default_max_tokens, serve.max_tokens_limit)
        resume_ids = list(req.get("resume_ids") or [])
        if len(resume_ids) >= max_tokens:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "resume_ids already reach max_tokens")
        context = prompt_ids + resume_ids
        params = SamplingParams(float(req.get("temperature") or 0.0), float(req.get("top_p") or 1.0), req.get("seed"))
        sampler = make_position_sampler(params, len(context), default_seed=random.getrandbits(62))
        self.prompt_tokens = len(prompt_ids)
        self.index = len(resume_ids)  # token indices continue after a resume
        self.completion = 0
        self.telemetry_every = req.get("telemetry_every") or serve.telemetry_every
        self.detokenizer = loaded.tokenizer.detokenizer
        for token in resume_ids:  # so that text deltas continue mid-character after a resume
            self.detokenizer.add_token(token)
        if resume_ids:
            _ = self.detokenizer.last_segment
        self.stream_before = stream_snapshot
        self.trace = None  # a TraceRecorder when the request is traced (set by the engine)
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        self.steps = generate_step(
            mx.array(context, dtype=mx.uint32),
            loaded.model,
            max_tokens=max_tokens - len(resume_ids),
            sampler=sampler,
            prompt_cache=make_prompt_cache(loaded.model),
            # A long prefill yields no token for a while; report progress so the watchdog waits.
            prompt_progress_callback=lambda done, total: on_progress() if on_progress else None,
        )

    def step(self) -> tuple[int | None, FinishReason | None]:
        """Advance one token; returns (token, None) or (None, finish reason)."""
        try:
            with recording(self.trace):
                token, _ = next(self.steps)
        except StopIteration:
            return None, FinishReason.LENGTH
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if token in self.tokenizer.eos_token_ids:
            return None, FinishReason.STOP
        return int(token), None

    def timings(self) -> dict:
        now = time.perf_counter()
        first = self.first_token_at or now
        decode_s = now - first
        return {
            "queued_s": self.started - self.job.received_at,
            "ttft_s": first - self.job.received_at,
            "prompt_tps": self.prompt_tokens / max(first - self.started, 1e-9),
            "decode_tps": (self.completion - 1) / decode_s if self.completion > 1 and decode_s > 0 else 0.0,
            "total_s": now - self.job.received_at,
        }


def tokenize_prompt(tokenizer: Any, req: dict) -> list[int]:
    """Tokenize as `mlx_lm.generate` does: the chat template unless raw, special tokens otherwise."""
    if req.get("prompt_ids") is not None:
        return list(req["prompt_ids"])
    prompt = req["prompt"]
    use_template = not req.get("raw") and getattr(tokenizer, "has_chat_template", False)
    if use_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not prompt.startswith(bos)
    ids = list(tokenizer.encode(prompt, add_special_tokens=add_special))
    if not ids:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "the prompt tokenizes to nothing")
    return ids


class Engine:
    """Owns the model; admits, steps, cancels and finishes generations on its own thread."""

    def __init__(self, serve: ServeConfig, model_path: Path, sink_factory: Callable[[], EventSink], status: EngineStatus):
        self.serve = serve
        self.model_path = model_path
        self.status = status
        self._sink_factory = sink_factory
        self._inbox: queue.Queue = queue.Queue()
        self._cancelled: dict[RequestKey, FinishReason | ErrorCode] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._active: OrderedDict[RequestKey, Generation] = OrderedDict()
        self.loaded: LoadedModel | None = None
        self.thread = threading.Thread(target=self._run, name="moed-engine", daemon=True)
        self.fatal: BaseException | None = None
        self.exit_code: int = DaemonExit.FAILED  # what the process exits with once `fatal` is set
        self.faults = Faults.parse(serve.debug_faults)  # off unless debug_faults says otherwise
        # Set by the server: record a crash durably before the in-flight requests are failed.
        self.on_crash: Callable[[CrashKind, str], None] | None = None

    # ---- called from other threads -------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: GenerateJob) -> None:
        self._inbox.put(job)
        self.status.add(queued_requests=1)

    def cancel(self, key: RequestKey, reason: FinishReason | ErrorCode = FinishReason.CANCELLED) -> None:
        with self._lock:
            self._cancelled[key] = reason

    def cancel_all(self, reason: FinishReason | ErrorCode) -> None:
        self._inbox.put(("cancel_all", reason))

    def shed(self, level: ShedLevel) -> None:
        self._inbox.put(("shed", level))

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("stop", None))

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        self.sink = self._sink_factory()
        try:
            t0 = time.perf_counter()
            log.info("loading %s (%s)", self.model_path, "resident" if self.serve.resident else f"streaming, budget {self.serve.cache_budget}")
            self.loaded = load_model(self.serve, self.model_path)
            self.status.update(
                state=DaemonState.READY.value,
                model=describe_model(self.loaded),
                load_s=round(time.perf_counter() - t0, 3),
                streaming=self._stream_snapshot(),
                memory_plan=self.loaded.streamer.plan.describe() if self.loaded.streamer else None,
            )
            log.info("model loaded from %s in %.2fs", self.model_path, time.perf_counter() - t0)
        except BaseException as exc:  # a model that cannot load is fatal for the daemon
            log.exception("model load failed")
            self._record_crash(CrashKind.LOAD_FAILED, f"{exc.__class__.__name__}: {exc}")
            if isinstance(exc, MemoryPlanRefused):
                self.exit_code = DaemonExit.DOES_NOT_FIT
            self.fatal = exc
            self.status.update(state=DaemonState.FAILED.value, error=f"{exc.__class__.__name__}: {exc}")
            self._fail_queued(ErrorCode.INTERNAL, f"model failed to load: {exc}")
            return
        while not self._stop.is_set() and self.fatal is None:
            self._drain_inbox(block=not self._active)
            self._apply_cancels()
            for key in list(self._active):
                if key in self._active:
                    self._step(key)
            self.status.update(active_requests=len(self._active), busy=bool(self._active))
        if self.fatal is None:
            self._finish_all(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        self._close_streamer()

    def _close_streamer(self) -> None:
        streamer = self.loaded.streamer if self.loaded else None
        if streamer is None:
            return
        try:
            streamer.save_profile()
        except OSError:
            log.exception("could not save the expert-usage profile")
        streamer.close()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: Any) -> None:
        if isinstance(item, GenerateJob):
            self.status.add(queued_requests=-1)
            self._admit(item)
            return
        command, arg = item
        if command == "cancel_all":
            self._finish_all(arg, "the daemon is shutting down")
        elif command == "shed":
            self._shed(arg)

    def _admit(self, job: GenerateJob) -> None:
        with self._lock:
            reason = self._cancelled.pop(job.key, None)
        if reason is not None:
            self._emit_terminal_cancel(job, reason)
            return
        try:
            gen = Generation(job, self.loaded, self.serve, self._stream_snapshot(),
                             on_progress=lambda: self.status.update(last_progress_at=time.time()))
            gen.trace = start_request_trace(self.loaded, job, self.serve, lambda m, i=job.identity: self.sink.emit(i, m),
                                            gen.prompt_tokens)
            self._active[job.key] = gen
            self.status.update(busy=True, active_requests=len(self._active))
        except ProtocolError as exc:
            self._emit_error(job, exc.code, exc.message)
        except Exception as exc:
            if is_out_of_memory(exc):  # the prefill ran out of memory
                self._out_of_memory(exc, also=job)
                return
            log.exception("request %r could not start", job.request.get("id"))
            self._emit_error(job, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")

    def _apply_cancels(self) -> None:
        with self._lock:
            if not self._cancelled:
                return
            pending = self._cancelled
            self._cancelled = {}
        for key, reason in pending.items():
            gen = self._active.get(key)
            if gen is not None:
                self._finish(gen, reason)
            else:  # still queued: remember until admission
                with self._lock:
                    self._cancelled.setdefault(key, reason)

    def _step(self, key: RequestKey) -> None:
        gen = self._active[key]
        try:
            if self.faults:
                self.faults.before_step(self.status.get("tokens_generated") or 0)
            token, finish = gen.step()
        except Exception as exc:
            if is_out_of_memory(exc):
                self._out_of_memory(exc)
                return
            log.exception("generation %r failed", gen.job.request.get("id"))
            self._active.pop(key, None)
            self.status.update(active_requests=len(self._active), busy=bool(self._active))
            self.status.add(requests_failed=1)
            self._emit_error(gen.job, ErrorCode.INTERNAL, f"{exc.__class__.__name__}: {exc}")
            return
        if finish is not None:
            self._finish(gen, finish)
            return
        gen.detokenizer.add_token(token)
        text = gen.detokenizer.last_segment
        self.sink.emit(gen.job.identity, wire.token(gen.job.request["id"], gen.index, [token], text))
        gen.index += 1
        gen.completion += 1
        self.status.token_produced(time.time())
        if gen.completion % gen.telemetry_every == 0:
            self.sink.emit(gen.job.identity, wire.telemetry(gen.job.request["id"], self._telemetry(gen)))

    def _telemetry(self, gen: Generation) -> dict:
        data = {"tokens": gen.completion, **gen.timings()}
        snapshot = self._stream_snapshot()
        if snapshot is not None:
            self.status.update(streaming=snapshot)
            data["experts"] = counters_delta(gen.stream_before, snapshot)
        return data

    def _out_of_memory(self, exc: BaseException, also: GenerateJob | None = None) -> None:
        """A Metal command-buffer failure: record it, fail every request, and let the process exit
        non-zero so that launchd restarts it (with a smaller cache budget)."""
        log.critical("out of memory: %s", exc)
        self._record_crash(CrashKind.OUT_OF_MEMORY, f"{exc.__class__.__name__}: {exc}")
        message = f"the daemon ran out of memory ({exc}); it restarts with a smaller expert cache"
        self.status.update(state=DaemonState.FAILED.value, error=f"out of memory: {exc}")
        if also is not None:
            self._emit_error(also, ErrorCode.OUT_OF_MEMORY, message)
        for gen in list(self._active.values()):
            self._finish(gen, ErrorCode.OUT_OF_MEMORY, message)
        self._fail_queued(ErrorCode.OUT_OF_MEMORY, message)
        self.exit_code = DaemonExit.OUT_OF_MEMORY
        self.fatal = exc  # last: the transport exits once it sees this, after flushing the errors

    def _record_crash(self, kind: CrashKind, message: str) -> None:
        if self.on_crash is None:
            return
        try:
            self.on_crash(kind, message)
        except Exception:  # the record is advisory; failing the requests is not
            log.exception("could not record the crash")

    def _finish(self, gen: Generation, reason: FinishReason | ErrorCode, message: str = "the daemon is shutting down") -> None:
        self._active.pop(gen.job.key, None)
        # Published before the terminal message, so a client that saw `done` sees the count drop.
        self.status.update(active_requests=len(self._active), busy=bool(self._active))
        req_id = gen.job.request["id"]
        finish_request_trace(gen.trace)  # its last chunk goes out before the terminal message
        if isinstance(reason, ErrorCode):
            self.status.add(requests_failed=1)
            self.sink.emit(gen.job.identity, wire.error(req_id, reason, message), terminal=True)
            return
        gen.detokenizer.finalize()
        tail = gen.detokenizer.last_segment
        if tail:
            self.sink.emit(gen.job.identity, wire.token(req_id, gen.index, [], tail))
        self.status.add(requests_served=1)
        usage = {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion}
        msg = wire.done(req_id, reason, usage, gen.timings(), telemetry=self._telemetry(gen))
        self.sink.emit(gen.job.identity, msg, terminal=True)

    def _finish_all(self, code: ErrorCode, message: str) -> None:
        for gen in list(self._active.values()):
            self._finish(gen, code)
        self._fail_queued(code, message)

    def _fail_queued(self, code: ErrorCode, message: str) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, GenerateJob):
                self.status.add(queued_requests=-1)
                self._emit_error(item, code, message)

    def _shed(self, level: ShedLevel) -> None:
        import mlx.core as mx

        released = 0
        if self.loaded is not None and self.loaded.streamer is not None:
            released = self.loaded.streamer.shed(0.5)
        mx.clear_cache()
        log.warning("shed level=%s released=%d bytes", level.value, released)
        cancelled = None
        if level is ShedLevel.CANCEL_NEWEST and self._active:
            newest = next(reversed(self._active.values()))
            cancelled = newest.job.request["id"]
            self._finish(newest, ErrorCode.OUT_OF_MEMORY, "cancelled to relieve memory pressure (the newest request is shed first)")
        self.status.add(sheds=1)
        self.status.update(last_shed={"level": level.value, "at": time.time(), "released_bytes": released, "cancelled": cancelled})

    def _emit_error(self, job: GenerateJob, code: ErrorCode, message: str) -> None:
        self.sink.emit(job.identity, wire.error(job.request["id"], code, message), terminal=True)

    def _emit_terminal_cancel(self, job: GenerateJob, reason: FinishReason | ErrorCode) -> None:
        if isinstance(reason, ErrorCode):
            self._emit_error(job, reason, "the daemon is shutting down")
        else:
            usage = {"prompt_tokens": 0, "completion_tokens": 0}
            self.sink.emit(job.identity, wire.done(job.request["id"], reason, usage, {}), terminal=True)

    def _stream_snapshot(self) -> dict | None:
        if self.loaded is None or self.loaded.streamer is None:
            return None
        return self.loaded.streamer.snapshot()


def describe_model(loaded: LoadedModel) -> dict:
    cfg = loaded.config
    text_cfg = cfg.get("text_config", {}) if isinstance(cfg.get("text_config"), dict) else {}
    return {
        "path": str(loaded.path),
        "name": loaded.path.name,
        "model_type": cfg.get("model_type"),
        "num_layers": cfg.get("num_hidden_layers") or text_cfg.get("num_hidden_layers"),
        "quantization": cfg.get("quantization"),
        "streaming": loaded.streamer is not None,
        "chat_template": bool(getattr(loaded.tokenizer, "has_chat_template", False)),
    }
