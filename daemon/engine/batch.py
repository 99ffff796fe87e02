"""The running batch: mlx-lm's BatchGenerator behind the few calls the engine core needs.

BatchGenerator already is continuous batching: requests join at token boundaries (a finished
prompt's row is appended to the decoding batch), leave when they finish (their row is filtered
out of the batched KV cache), and prompts are read in chunks of `prefill_chunk` tokens, one chunk
per step after the decode step, so long prompts never freeze the decoding rows. Each row keeps its
own sampler (called once per position, so position-keyed seeds stay reproducible).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from moed.daemon.engine.chunk_budget import ChunkBudget
from moed.daemon.engine.decode_mask import fit_masks
from moed.daemon.engine.prefix_cache.ladder import DecodeLadder
from moed.daemon.engine.sampling import greedy
from moed.daemon.ground.device_errors import classify
from moed.daemon.ground.faults import SyncPoint
from moed.daemon.model.layer_caches import (
    LayerCache,
    RemoteLayers,
    cache_nbytes,
    extract_state,
    lone_state,
)
from moed.daemon.model.mlx_compat import (
    generation_batch,
    move_whole_splits,
    next_tokens,
    prompt_batch,
    scope_prompt_ends,
    set_prefill_step,
)
from moed.protocol import FinishReason

if TYPE_CHECKING:
    from moed.daemon.engine.prefix_cache.cache import PrefixHit

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # (row tokens, row logits)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}

# While rows decode, a prompt chunk is sized from measured times to cost about this many decode
# steps, so the decoding streams' gap between tokens stays near (1 + CHUNK_STEPS) x its median
# whatever the machine (a 256-token chunk costs ~2 decode steps on a GPU, ~50 on a 2-core CPU).
# A chunk is a forward pass of its own (BatchGenerator), so even 2 tokens cost about one step.
CHUNK_STEPS = 1.5
MIN_CHUNK = 2  # a long prompt still moves when a chunk's fixed cost alone exceeds the target
_EMA = 0.3  # weight of the newest decode step in the running mean


@dataclass(frozen=True)
class TokenOut:
    """A row's new token; with `finish` set the row has left the batch (a STOP token is EOS)."""

    uid: int
    token: int
    finish: FinishReason | None
    logprobs: mx.array  # the row's distribution the token was sampled from


@dataclass(frozen=True)
class PromptProgress:
    """A chunk of a row's prompt was read: `done` of `total` context tokens."""

    uid: int
    done: int
    total: int


@dataclass(frozen=True)
class SavedRow:
    """A row's caches for the prefix cache: the `tokens` its layers hold, with recurrent-state
    checkpoints (position -> the untrimmable layers' caches); at its prompt's end or its end."""

    uid: int
    tokens: list[int]
    layers: list[LayerCache]
    checkpoints: dict[int, list[LayerCache]]
    scope: str  # whose (prefix_cache/scope.py): kept where only its scope finds it


@dataclass
class _RowPrefix:
    """What the prefix cache wants from a row while its prompt is read."""

    context: list[int]
    start: int  # context tokens its caches held when it joined
    wanted: frozenset[int]  # positions to checkpoint recurrent state at
    scope: str  # the prefix-cache scope its caches are kept in
    checkpoints: dict[int, list[LayerCache]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutput:
    prompts: tuple[PromptProgress, ...]
    tokens: tuple[TokenOut, ...]
    saved: tuple[SavedRow, ...] = ()


class ChunkSizer:
    """The prefill chunk of the next step: when no row decodes, as large as the memory plan allows
    (engine/chunk_budget.py; at least `prefill_chunk`; a streamed model only, else no budget);
    beside decoding rows, a size steered each
    step (proportionally,
    so a chunk's fixed cost and its per-token cost both count) towards a chunk that costs
    CHUNK_STEPS decode steps."""

    def __init__(
        self, max_chunk: int, budget: ChunkBudget | None = None, limit: int | None = None
    ) -> None:
        self.max_chunk = max_chunk
        self.budget = budget  # a lone prompt's chunk from the memory plan; None: max_chunk
        # A ceiling over all of it, set by a recovery in place (a smaller command buffer).
        self.limit = limit
        self.size = min(MIN_CHUNK, max_chunk)  # beside decoding rows
        self.decode_s: float | None = None  # running mean of a decode-only step

    def chunk(self, decoding: bool, prompting: int = 1, longest: int = 0) -> int:
        """Beside decoding rows, the steered size; else as large as the plan allows for the
        `prompting` rows read together (padded to the `longest` row's KV tokens); never over
        `limit`."""
        if decoding:
            size = self.size
        elif self.budget is None:
            size = self.max_chunk
        else:
            lone = self.budget.alone(max(1, prompting) * longest, longest)
            size = max(self.max_chunk, lone // max(1, prompting))
        return size if self.limit is None else min(size, self.limit)

    def measured(self, step_s: float, decoded: bool, prompt_tokens: int) -> None:
        if not decoded:
            return
        if not prompt_tokens:
            self.decode_s = (
                step_s if self.decode_s is None else ((1 - _EMA) * self.decode_s + _EMA * step_s)
            )
        elif self.decode_s is not None and prompt_tokens >= self.size:
            cost = max(step_s - self.decode_s, 1e-6)
            # Halve or double at most per step: one noisy step never swings it far.
            scale = min(2.0, max(0.5, CHUNK_STEPS * self.decode_s / cost))
            self.size = max(MIN_CHUNK, min(self.max_chunk, round(self.size * scale)))


class DecodeBatch:
    """One batched KV cache for every running request: one forward pass per step for all rows."""

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: Iterable[int],
        max_batch: int,
        prefill_chunk: int,
        budget: ChunkBudget | None = None,
        trimmable: tuple[bool, ...] | None = None,
        unused_output: Callable[[], AbstractContextManager[None]] = nullcontext,
        prompt_end: Callable[[], AbstractContextManager[None]] | None = None,
        ladder: DecodeLadder | None = None,
        chunk_limit: int | None = None,
        on_sync: Callable[[SyncPoint], None] | None = None,
    ) -> None:
        self._eos = frozenset(int(t) for t in eos_token_ids)
        stop = [[t] for t in sorted(self._eos)]
        self._gen = BatchGenerator(
            model,
            stop_tokens=stop or None,
            sampler=greedy,
            # The scheduler admits at most max_batch rows in all: these limits never bind first.
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=prefill_chunk,
        )
        move_whole_splits(self._gen)  # a prompt's end copies no cache
        if prompt_end is not None:  # entered around each step reading prompts' last tokens
            scope_prompt_ends(self._gen, prompt_end)
        self._live: set[int] = set()  # rows inserted and not yet finished or removed
        self._decoding: set[int] = set()  # ... of them past their prompt
        self._early: set[int] = set()  # ... whose first token went out before the generator's
        self._read: dict[int, int] = {}  # prompt tokens read so far, per prompting row
        # Each live row's context (prompt and resumed tokens): while no row decodes, the KV the
        # batch holds and what a prompt chunk's attention reads (its max_tokens, up to the rest
        # of the context for an open-ended request, is KV it has not grown yet).
        self._context: dict[int, int] = {}
        self._sizer = ChunkSizer(prefill_chunk, budget, chunk_limit)
        # The largest prompt chunk this batch may read (its steps' chunks so far, or the
        # configured one): a recovery from a timeout halves it.
        self.largest_chunk = min(prefill_chunk, chunk_limit or prefill_chunk)
        # Called once a step's tokens are read back (tests inject device failures there).
        self._on_sync = on_sync
        self._rows_seen: tuple[int, ...] = ()  # the decoding rows the masks were fitted to
        # With a prefix cache: which layers can be cut back, and what each row owes it.
        self._trimmable = trimmable
        self._prefix: dict[int, _RowPrefix] = {}
        self._ladder = ladder  # a hybrid model's checkpoints while a row decodes alone
        # Entered around each generator step: its prompt chunks' model outputs are never read
        # (mlx_compat.py, use 8), which a streaming model uses to skip its last layer's experts.
        self._unused_output = unused_output

    @property
    def rows(self) -> int:
        return len(self._live)

    def insert(
        self,
        context: list[int],
        max_new_tokens: int,
        sampler: Sampler,
        constraint: LogitsProcessor | None = None,
        hit: PrefixHit | None = None,
        checkpoints: tuple[int, ...] = (),
        scope: str = "",
    ) -> int:
        """Queue a request's context for prefill; returns its row id. A `constraint` (a grammar's
        token mask) applies to this row's logits only. With a prefix-cache `hit` (a PrefixHit) the
        row starts from its caches and reads only the rest; the prompt is cut into segments at
        `checkpoints` so that the row's recurrent state can be kept there; what the row keeps
        for the prefix cache goes to `scope`."""
        start = hit.length if hit is not None else 0
        cuts = [p for p in checkpoints if start < p < len(context) - 1]
        if self._trimmable is not None and len(context) - 1 > start:
            cuts.append(len(context) - 1)  # the prompt's end: the whole row is kept there
        segments: list[list[int]] = []
        at = start
        for cut in cuts:
            segments.append(context[at:cut])
            at = cut
        segments.append(context[at:])
        uid: int
        (uid,) = self._gen.insert_segments(
            [segments],
            max_tokens=[max_new_tokens],
            caches=[hit.caches] if hit is not None else None,
            all_tokens=[list(context[:start])] if hit is not None else None,
            samplers=[sampler],
            logits_processors=[[constraint] if constraint is not None else []],
        )
        self._live.add(uid)
        self._context[uid] = len(context)
        if self._trimmable is not None:
            inherited = dict(hit.inherited) if hit is not None else {}
            self._prefix[uid] = _RowPrefix(context, start, frozenset(cuts), scope, inherited)
        return uid

    def remove(self, uid: int, keep: bool = False) -> SavedRow | None:
        """Drop a row (cancelled, failed or ended by the engine); a row that already finished is
        ignored. With `keep`, returns its caches for the prefix cache."""
        if uid not in self._live:
            return None
        row = self._prefix.get(uid)
        self._forget(uid)
        caches = self._gen.remove([uid], return_prompt_caches=keep and row is not None)
        self._fit_masks()
        if uid not in caches:
            return None
        layers, tokens = caches[uid]
        assert row is not None  # caches come back only for a row with a prefix (keep)
        if not layers or len(tokens) <= row.start:
            return None  # nothing read that the cache does not hold already
        return SavedRow(uid, list(tokens), list(layers), dict(row.checkpoints), row.scope)

    def _forget(self, uid: int) -> None:
        self._live.discard(uid)
        self._decoding.discard(uid)
        self._early.discard(uid)
        self._read.pop(uid, None)
        self._prefix.pop(uid, None)
        self._context.pop(uid, None)

    def step(self) -> StepOutput:
        """One decode step for the decoding rows, then one prefill chunk for the prompting rows."""
        prompting = len(self._live) - len(self._decoding)
        longest = max(self._context.values(), default=0)  # the batch pads every row to it
        chunk = self._sizer.chunk(bool(self._decoding), prompting, longest)
        if prompting:
            self.largest_chunk = max(self.largest_chunk, chunk)
        set_prefill_step(self._gen, chunk)
        t0 = time.perf_counter()
        with self._unused_output():
            prompts, generated = self._gen.next()  # reads the tokens of its previous step back
        if self._on_sync is not None:
            self._on_sync(SyncPoint.EVAL)
        step_s = time.perf_counter() - t0
        saved = self._capture(prompts) if self._prefix else []
        tokens = []
        for r in generated:
            finish = _FINISH.get(r.finish_reason) if r.finish_reason else None
            if r.uid in self._early:  # out already (_first_tokens); it cannot finish the row
                self._early.discard(r.uid)
                if finish is None:
                    continue
            if finish is not None:
                row = self._prefix.get(r.uid)
                if row is not None and r.prompt_cache:
                    saved.append(
                        SavedRow(
                            r.uid,
                            list(r.all_tokens),
                            r.prompt_cache,
                            dict(row.checkpoints),
                            row.scope,
                        )
                    )
                self._forget(r.uid)
            else:
                self._decoding.add(r.uid)
            tokens.append(TokenOut(r.uid, int(r.token), finish, r.logprobs))
        progress = tuple(PromptProgress(p.uid, *_progress(p.progress)) for p in prompts)
        read = 0
        for p in progress:
            read += max(0, p.done - self._read.get(p.uid, 0))
            self._read[p.uid] = p.done
            if p.done >= p.total:
                self._read.pop(p.uid, None)
        self._sizer.measured(step_s, bool(generated), read)
        if self._ladder is not None and self._prefix:
            self._climb(self._ladder)
        self._fit_masks()
        ended = [p.uid for p in progress if p.done >= p.total and p.uid not in self._decoding]
        if ended:  # a decode step has none: no lookup in the generator's rows
            tokens += self._first_tokens(ended)
        return StepOutput(progress, tuple(tokens), tuple(saved))

    def _first_tokens(self, ended: list[int]) -> list[TokenOut]:
        """The first token of each row whose prompt ended this step, out now. The generator
        hands a token out at the step after the one computing it, once that step's graph is
        built: under host-routed streaming building a step computes most of it (a read-back a
        layer), so the first token would wait for the second. The generator still counts the
        token at its next step, where step() drops it; a token that would end its row there
        (an end of sequence, a one-token request) is left to it, so only tokens without a
        finish go out early. Any later token keeps the generator's pace (its overlap)."""
        firsts = next_tokens(self._gen, ended)
        if not firsts:
            return []
        mx.eval([f.token for f in firsts])  # the step that just ran computed them
        if self._on_sync is not None:
            self._on_sync(SyncPoint.EVAL)
        out = []
        for f in firsts:
            token = int(f.token.item())  # type: ignore[arg-type]  # mlx types item() int/float/complex
            if token in self._eos or f.max_tokens <= 1:
                continue
            self._early.add(f.uid)
            self._decoding.add(f.uid)
            out.append(TokenOut(f.uid, token, None, f.logprobs))
        return out

    def _capture(self, prompts: list[Any]) -> list[SavedRow]:
        """Keep what the prefix cache asked for of the rows whose prompt segment just ended: the
        recurrent state at a checkpoint, the whole row at its prompt's end."""
        saved: list[SavedRow] = []
        trimmable = self._trimmable
        assert trimmable is not None  # rows have a prefix only with a prefix cache
        batch = prompt_batch(self._gen)
        for p in prompts:
            row = self._prefix.get(p.uid)
            if row is None or not p.end_of_segment or p.uid not in batch.uids:
                continue
            pos = row.start + int(p.progress[0])
            if pos not in row.wanted:
                continue
            idx = batch.uids.index(p.uid)
            if pos == len(row.context) - 1:
                layers = batch.extract_cache(idx)
                kept = SavedRow(p.uid, row.context[:pos], layers, dict(row.checkpoints), row.scope)
                saved.append(kept)
                if not all(trimmable):
                    row.checkpoints[pos] = [c for c, t in zip(layers, trimmable) if not t]
            else:
                row.checkpoints[pos] = [
                    extract_state(c, idx)
                    for c, cut in zip(batch.prompt_cache, trimmable)
                    if not cut
                ]
        return saved

    def _climb(self, ladder: DecodeLadder) -> None:
        """A row decoding alone keeps its untrimmable layers' state on a ladder behind its
        newest token (prefix_cache/ladder.py). Beside other rows it keeps none: a row's slice
        would hold the whole batch's state alive at every rung."""
        batch = generation_batch(self._gen)
        if len(batch.uids) != 1 or (row := self._prefix.get(batch.uids[0])) is None:
            return
        trimmable = self._trimmable
        assert trimmable is not None  # rows have a prefix only with a prefix cache
        caches = [c for c, cut in zip(batch.prompt_cache, trimmable) if not cut]
        if any(isinstance(c, RemoteLayers) for c in caches):
            return  # a pipeline's other ranks hold them: checkpoints at prompt segments only
        start, now = len(row.context), len(batch.tokens[0])
        state = [lone_state(c) for c in caches]
        rungs = [p for p in row.checkpoints if p >= start]
        row.checkpoints[now] = state
        for p in ladder.drop([*rungs, now], now, start, cache_nbytes(state)):
            del row.checkpoints[p]

    def _fit_masks(self) -> None:
        decoding = generation_batch(self._gen)  # its rows and per-layer caches
        if tuple(decoding.uids) != self._rows_seen:
            self._rows_seen = tuple(decoding.uids)
            fit_masks(decoding.prompt_cache)

    def close(self) -> None:
        self._gen.close()

    def abandon(self) -> None:
        """Drop the batch after a device failure: its caches and pending tokens depend on the
        failed command buffer. Closing waits on the generator's stream, where the failure may
        be raised once more; that one is the failure already being handled."""
        try:
            self._gen.close()
        except RuntimeError as exc:
            if classify(exc) is None:
                raise


def _progress(progress: object) -> tuple[int, int]:
    if isinstance(progress, tuple) and len(progress) == 2:
        return int(progress[0]), int(progress[1])
    return 0, 0
