"""One generation: a request's context, position-keyed sampler, stop rule, detokenizer and timings.

Its KV cache is its row of the running batch (engine/batch.py); this object holds the rest.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moed.daemon.config import ServeConfig
from moed.daemon.engine.grammar import GrammarConstraint, grammar_for, ll_tokenizer
from moed.daemon.engine.grammar_compile import GrammarCache, GrammarLimits, cached_matcher
from moed.daemon.engine.logprobs import token_logprobs
from moed.daemon.engine.prefix_cache.scope import cache_scope
from moed.daemon.engine.reasoning import ReasoningSplit, Segment, initial_channel
from moed.daemon.engine.sampling import SamplingParams, make_position_sampler
from moed.daemon.engine.stop_sequences import StopSequences
from moed.daemon.engine.text_path import TextGuard
from moed.daemon.engine.tool_calls import ToolCalls
from moed.daemon.ground.faults import Faults, TextStage
from moed.daemon.model.chat_template import prompt_token_ids
from moed.daemon.model.limits import limits_for
from moed.daemon.model.loader import LoadedModel
from moed.daemon.telemetry.trace import TraceRecorder
from moed.protocol import Channel, GenerateRequest
from moed.protocol.generate import RequestId
from moed.protocol.validation import (
    check_context,
    check_max_tokens,
    check_token_ids,
    resolve_max_tokens,
)

if TYPE_CHECKING:  # types only
    from moed.daemon.engine.batch import Sampler

RequestKey = tuple[bytes, RequestId]  # (client identity, client-chosen request id)


@dataclass(frozen=True)
class GenerateJob:
    """A validated generate as the engine receives it: who asked, under which id, for what."""

    identity: bytes
    request_id: RequestId
    request: GenerateRequest  # built once by the edge's validation
    received_at: float = field(default_factory=time.perf_counter)

    @property
    def key(self) -> RequestKey:
        return (self.identity, self.request_id)


@dataclass(frozen=True)
class Emitted:
    """What one sampled token (or the end of the stream) sends: its text by channel, in order,
    logprobs, tool calls."""

    segments: tuple[Segment, ...]
    logprobs: list[dict[str, Any]] | None
    tool_calls: list[dict[str, Any]]
    stopped: bool  # a stop string matched (or the one allowed tool call ended): it ends here

    @property
    def text(self) -> str:
        """The answer's text (reasoning left out)."""
        return "".join(text for channel, text in self.segments if channel is Channel.ANSWER)


class Generation:
    """One request's decoding state outside the model: what to run, how to sample, what went out."""

    def __init__(
        self,
        job: GenerateJob,
        loaded: LoadedModel,
        serve: ServeConfig,
        stream_snapshot: dict[str, Any] | None,
        faults: Faults | None = None,
    ):
        req = job.request
        self.job = job
        self.tokenizer = loaded.tokenizer
        prompt_ids = prompt_token_ids(loaded.tokenizer, req)
        resume_ids = list(req.resume_ids)
        # The text prompt is checked here, once tokenized: same rules as prompt_ids at the edge.
        limits = limits_for(serve, loaded.config)
        max_tokens = resolve_max_tokens(req.max_tokens, len(prompt_ids), limits, req.open_ended)
        check_context(len(prompt_ids), len(resume_ids), max_tokens, limits)
        if req.strict_max_tokens:
            check_max_tokens(req.max_tokens, len(prompt_ids), limits)
        check_token_ids(prompt_ids, limits)
        asked = req.max_tokens
        self.notice = (
            f"max_tokens {asked} capped at {max_tokens} (limits.max_tokens, or the context "
            "left after the prompt)"
            if asked is not None and asked > max_tokens
            else None
        )
        # Every stage after the step is contained per row (text_path.py).
        self.guard = TextGuard.for_prompt(faults, loaded.tokenizer, prompt_ids)
        self.context = prompt_ids + resume_ids  # what the model reads before the first new token
        self.max_new_tokens = max_tokens - len(resume_ids)
        self.resume_ids = resume_ids
        self.generated: list[int] = []  # the tokens sent since, in order (a rejoin reads them)
        self._params = SamplingParams(
            float(req.temperature or 0.0), float(req.top_p or 1.0), req.seed
        )
        self._seed = random.getrandbits(62)  # kept: a rejoined row samples the same positions
        self.sampler = make_position_sampler(
            self._params, len(self.context), default_seed=self._seed
        )
        self.prompt_tokens = len(prompt_ids)
        self.index = len(resume_ids)  # token indices continue after a resume
        self.completion = 0
        self.telemetry_every = req.telemetry_every or limits.telemetry_every
        self.stops = StopSequences(req.stop)
        # An answer held to `format` is JSON: a `<tool_call>` inside one of its strings is text.
        self.tool_calls = ToolCalls(
            loaded.tokenizer,
            req.template_tools if req.format is None else None,
            forced=req.forced_tool_calls,
        )
        # parallel_tool_calls false: the answer ends with its first tool call.
        self.one_tool_call = req.parallel_tool_calls is False
        # A row held to a grammar splits its reasoning by the grammar's rule (reasoning.py).
        self.reasoning = ReasoningSplit(
            loaded.tokenizer,
            req.templated,
            initial_channel(loaded.tokenizer, prompt_ids),
            held=req.format is not None or req.forced_tool_calls,
        )
        # Whether the reasoning is open where the context ends: the grammar waits for its end.
        self._reasoning_open = self.reasoning.channel is Channel.REASONING
        # The row's grammar (a logits processor), when `format` or a forced tool_choice asks:
        # built on the grammar pool's threads (`constraint_build`), set before the row joins.
        self.constraint: GrammarConstraint | None = None
        self.wants_grammar = req.format is not None or req.forced_tool_calls
        self._grammar_compiles: tuple[GrammarCache, GrammarLimits] | None = None
        self.top_logprobs: int | None = req.logprobs  # None: the request wants none
        self.detokenizer = loaded.tokenizer.detokenizer
        for token in resume_ids:  # so that text deltas continue mid-character after a resume
            self.detokenizer.add_token(token)
        if resume_ids:  # the channel continues where the resumed tokens left it
            self.reasoning.replay(self.detokenizer.last_segment, resume_ids)
        self.stream_before = stream_snapshot
        self.trace: TraceRecorder | None = None  # when the request is traced (set by the engine)
        self.uid: int | None = None  # its row id in the running batch, once admitted
        self.started: float | None = None  # when it joined the batch
        self.first_token_at: float | None = None
        self.cached_tokens = 0  # context tokens the prefix cache held when it joined the batch
        # Whose cached prefixes it may resume from and keeps its own in (prefix_cache/scope.py).
        self.cache_scope = cache_scope(req.principal, req.cache_salt)

    @property
    def client(self) -> bytes:
        """Whom the request counts against when rows and grammar compiles go in turn: its
        connection, and the principal and caller it names behind a connection that serves many."""
        req = self.job.request
        if req.principal is None and req.caller is None:
            return self.job.identity
        behind = f"{req.principal or ''}\0{req.caller or ''}".encode()
        return self.job.identity + b"\0" + behind

    def constraint_build(
        self, cache: GrammarCache, limits: GrammarLimits
    ) -> Callable[[], GrammarConstraint | None]:
        """The work that makes this row's grammar constraint, for a grammar pool thread: it reads
        only the request and the tokenizer, never the engine's state."""
        self._grammar_compiles = (cache, limits)  # a rejoin builds it again from the cache
        return functools.partial(self._grammar_after, list(self.resume_ids))

    def _grammar_after(self, tokens: list[int]) -> GrammarConstraint | None:
        """The row's constraint advanced past `tokens`, from the compile cache (any thread: it
        reads only the request, the tokenizer and what this row was built with)."""
        source = grammar_for(self.job.request, self.tokenizer)
        if source is None or self._grammar_compiles is None:
            return None
        cache, limits = self._grammar_compiles
        matcher = cached_matcher(cache, ll_tokenizer(self.tokenizer), source, limits)
        return GrammarConstraint(self.tokenizer, matcher, self._reasoning_open, tokens, self.guard)

    @property
    def kv_tokens(self) -> int:
        """The KV rows this request can grow to (its context and every token it may add)."""
        return len(self.context) + self.max_new_tokens

    def rejoin(self) -> tuple[list[int], int, Sampler, GrammarConstraint | None]:
        """What the row needs to join a new batch and continue where its stream is (a recovery
        in place, by recompute): the context with every token sent so far, the tokens left, a
        sampler at the next position and the grammar advanced past the sent tokens. The
        detokenizer, the channel split, stops and tool calls go on as they are."""
        context = self.context + self.generated
        self.sampler = make_position_sampler(self._params, len(context), default_seed=self._seed)
        # Built here, on the engine thread: the compile cache holds this row's grammar.
        self.constraint = self._grammar_after(self.resume_ids + self.generated)
        return context, self.max_new_tokens - len(self.generated), self.sampler, self.constraint

    def add_token(self, token: int, logprobs: Any = None) -> Emitted:
        """Detokenize a sampled token: the text to send by channel (think markers, tool calls and
        stop strings cut out), its logprobs if asked, finished tool calls, and whether the text
        ended (a stop string matched). `logprobs` is the distribution the token was sampled
        from (this request's row). A stage that raises raises RowFailed (text_path.py)."""
        self.generated.append(token)
        guard = self.guard
        guard.tokens = self.completion
        with guard(TextStage.DETOKENIZE):
            self.detokenizer.add_token(token)
            delta = self.detokenizer.last_segment
        with guard(TextStage.REASONING):
            split = self.reasoning.feed(delta, token)
        segments, calls = self._route(split, False, token=token)
        entries = None
        if self.top_logprobs is not None:
            with guard(TextStage.LOGPROBS):
                entries = [token_logprobs(logprobs, token, self.top_logprobs, self.tokenizer)]
        return Emitted(segments, entries, calls, self._ended)

    def final_text(self, cut: bool = False) -> Emitted:
        """What is still held back (by the detokenizer, a marker, a tool call or a stop) at the
        end; `cut`: the answer was cut short (max_tokens, a cancel), so a tool call still open
        is dropped, never sent as text or as a call."""
        if self._ended:
            return Emitted((), None, [], True)
        guard = self.guard
        with guard(TextStage.DETOKENIZE):
            self.detokenizer.finalize()
            delta = self.detokenizer.last_segment
        with guard(TextStage.REASONING):
            split = self.reasoning.feed(delta) + self.reasoning.flush()
        segments, calls = self._route(split, True, cut)
        return Emitted(segments, None, calls, False)

    @property
    def _ended(self) -> bool:
        one_call_made = self.one_tool_call and self.tool_calls.made > 0
        return self.stops.matched is not None or one_call_made

    def _route(
        self, split: list[Segment], final: bool, cut: bool = False, token: int | None = None
    ) -> tuple[tuple[Segment, ...], list[dict[str, Any]]]:
        """Reasoning goes out as it is; the answer passes the tool-call cutter and the stops.
        Nothing goes out once the text ended."""
        guard = self.guard
        out: list[Segment] = []
        calls: list[dict[str, Any]] = []
        for channel, text in split:
            if self._ended:
                break
            if channel is Channel.ANSWER:
                with guard(TextStage.TOOL_CALLS):
                    text, made = self.tool_calls.feed(text, token)
                calls.extend(made)
                with guard(TextStage.STOPS):
                    text = self.stops.feed(text)
            out.append((channel, text))
        if final and not self._ended:
            with guard(TextStage.TOOL_CALLS):
                rest, more = self.tool_calls.flush(cut)
            calls.extend(more)
            with guard(TextStage.STOPS):
                rest = self.stops.feed(rest) + self.stops.flush()
            out.append((Channel.ANSWER, rest))
        if self.one_tool_call and len(calls) > 1:
            calls = calls[:1]
        return tuple((c, t) for c, t in out if t), calls

    def timings(self) -> dict[str, Any]:
        now = time.perf_counter()
        started = self.started or now
        first = self.first_token_at or now
        decode_s = now - first
        return {
            "queued_s": started - self.job.received_at,
            "ttft_s": first - self.job.received_at,
            "prompt_tps": self.prompt_tokens / max(first - started, 1e-9),
            "decode_tps": (self.completion - 1) / decode_s
            if self.completion > 1 and decode_s > 0
            else 0.0,
            "total_s": now - self.job.received_at,
        }
