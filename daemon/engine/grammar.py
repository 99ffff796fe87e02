"""Constrained decoding with llguidance: a request's answer is held to a grammar by a token mask
applied to its own row's logits before sampling (rows without a grammar are untouched).

The grammar comes from the request: `format` (JSON, or JSON under a schema) or a forced
`tool_choice` (the model's own tool-call format around the tools' parameter schemas, see
engine/tool_grammar.py). A grammar llguidance cannot compile is a typed `invalid_schema` error
before the request starts. While the row is in its reasoning channel the mask waits: the grammar
holds the answer, from the think end marker on.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from moed.daemon.engine.grammar_tokens import marker_tokens
from moed.daemon.engine.reasoning import ThinkEnd
from moed.daemon.engine.schema_prep import prepared
from moed.daemon.engine.text_path import RowFailed, TextGuard
from moed.daemon.engine.tool_grammar import tool_call_grammar
from moed.daemon.ground.faults import TextStage
from moed.daemon.model.mlx_compat import hf_tokenizer
from moed.protocol import ErrorCode, GenerateRequest, NamedTool, ProtocolError
from moed.protocol.constraints import FormatType, tool_name

if TYPE_CHECKING:  # types only: llguidance is imported where a grammar is built
    from llguidance import LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions  # exported only from its stub module

log = logging.getLogger("moed.engine")

# Compact JSON: a model cannot spin in whitespace, so a bounded schema ends in bounded tokens. A
# oneOf is held exactly or refused (schema_prep.py), never coerced to anyOf.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "coerce_one_of": False}
ANY_OBJECT = {"type": "object"}

_MASK_BITS = 32  # bit i of a mask word is token 32 * word + i
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
# The grammar pool's workers build it concurrently: two views of one tokenizer would key the
# grammar cache twice (a schema compiled twice, a compile's outcome not found by its resender).
_LL_TOKENIZERS_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Any) -> LLTokenizer:
    """llguidance's view of the model's tokenizer, built once per loaded tokenizer (~1 s for a
    large vocabulary) from the Hugging Face fast tokenizer."""
    with _LL_TOKENIZERS_LOCK:
        cached = _LL_TOKENIZERS.get(tokenizer)
        if cached is None:
            import llguidance.hf

            hf = hf_tokenizer(tokenizer)
            eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ()) or None
            cached = llguidance.hf.from_tokenizer(hf, eos_token=eos)
            _LL_TOKENIZERS[tokenizer] = cached
        return cached


def _invalid(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_SCHEMA, message)


def explained(message: str) -> str:
    """llguidance's refusal, in the words of what moed enforces (its own hint names an option
    moed leaves off on purpose)."""
    if "oneOf constraints are not supported" in message:
        return (
            "'oneOf' is enforced exactly only where its branches cannot overlap (different "
            "types, a const or enum that tells them apart); these may, and an answer matching "
            "two branches would not validate: use 'anyOf' if either may match"
        )
    return message[:500]


def grammar_for(req: GenerateRequest, tokenizer: Any) -> str | None:
    """The llguidance grammar a generate asks for; None when its answer is free (then llguidance
    is not imported: a recovery's rejoin of plain rows runs where it is not installed)."""
    fmt = req.format
    if fmt is not None:
        from llguidance import LLMatcher

        schema = fmt.schema if fmt.type is FormatType.JSON_SCHEMA else None
        try:
            return LLMatcher.grammar_from_json_schema(
                json.dumps(prepared(schema) if schema else ANY_OBJECT), overrides=JSON_OPTIONS
            )
        except (ValueError, TypeError) as exc:
            raise _invalid(
                f"format.schema is not a JSON schema llguidance accepts: {exc}"
            ) from None
    if not req.forced_tool_calls:
        return None
    forced = req.tool_choice.name if isinstance(req.tool_choice, NamedTool) else None
    tools = [dict(t) for t in req.tools if forced is None or tool_name(t) == forced]
    return tool_call_grammar(tokenizer, tools, many=req.parallel_tool_calls is not False)


class GrammarConstraint:
    """One row's grammar state: an mlx-lm logits processor (called once per sampled position with
    the row's tokens so far and its logits) that advances the matcher by the previous token and
    masks every token the grammar does not allow next."""

    def __init__(
        self,
        tokenizer: Any,
        matcher: LLMatcher,
        reasoning: bool,
        resumed: list[int],
        guard: TextGuard | None = None,
    ):
        self.lltok = ll_tokenizer(tokenizer)
        self.matcher = matcher  # compiled for this row alone (engine/grammar_compile.py)
        # The grammar holds the answer: with the reasoning open, it waits for the think end's
        # tokens (the row's reasoning split switches at the same ids: reasoning.py, held).
        self.waiting = reasoning
        self._think_end = ThinkEnd(tokenizer)
        self._eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._markers = marker_tokens(tokenizer, self.lltok, self._eos)
        self._first = True
        self.guard = guard or TextGuard()
        # Why the row cannot go on (the engine fails it before its next token goes out): the
        # stage raised (RowFailed), or the matcher met a dead end the schema led it into.
        self.failure: RowFailed | ProtocolError | None = None
        for token in resumed:
            self._advance(token)
        if self.failed:
            raise _invalid(f"resume_ids leave the grammar: {self.failed[:300]}")

    @property
    def failed(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        """Never raises (it runs inside the batch's step, for every row): a failure is kept in
        `failure`, and the row gets only the end of sequence until the engine fails it."""
        if self.failure is None:
            try:
                with self.guard(TextStage.GRAMMAR):
                    return self._masked(context, logits)
            except RowFailed as exc:
                self.failure = exc
        try:
            return self._masked_to(self._eos_only(logits.shape[-1]), logits)
        except Exception:  # the row is failed before this position's token goes out
            return logits

    def _masked(self, context: mx.array, logits: mx.array) -> mx.array:
        if not self._first:  # the token sampled at the previous call ends the context
            self._advance(int(context[-1].item()))  # type: ignore[arg-type]  # mlx types item() int/float/complex
        self._first = False
        if self.waiting:
            return logits
        words = None
        if not self.failed:
            packed = np.frombuffer(self.matcher.compute_bitmask(), np.uint32)
            words = self._markers.fix(self.matcher, packed)
        if words is None or not words.any():  # a dead end the schema led the matcher into
            why = self.failed or "no token can continue it"
            self.failure = _invalid(f"the schema's grammar cannot complete the answer: {why:.300}")
            return self._masked_to(self._eos_only(logits.shape[-1]), logits)
        return self._masked_to(self._allowed(words, logits.shape[-1]), logits)

    @staticmethod
    def _masked_to(allowed: mx.array, logits: mx.array) -> mx.array:
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _advance(self, token: int) -> None:
        if self.waiting:
            self.waiting = not self._think_end.seen(token)
            return
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
            log.warning(
                "the grammar refused sampled token %d; the answer ends: %.300s", token, self.failed
            )

    def _eos_only(self, width: int) -> mx.array:
        allowed = np.zeros(width, dtype=np.bool_)
        allowed[[t for t in self._eos if t < width]] = True
        return mx.array(allowed)

    @staticmethod
    def _allowed(packed: np.ndarray, width: int) -> mx.array:
        # The packed words go to MLX as they are (vocab/32 of them) and expand there, in the
        # step's graph: no per-token host loop over a 150k vocabulary.
        words = mx.array(packed)
        # Built on the engine thread, in the graph: an array made at import would belong to the
        # importing thread's stream, which MLX refuses to evaluate on another thread.
        bits = mx.arange(_MASK_BITS, dtype=mx.uint32)
        allowed = ((words[:, None] >> bits) & 1).reshape(-1).astype(mx.bool_)
        if allowed.size < width:  # ids past the tokenizer (a padded embedding) are never allowed
            allowed = mx.concatenate([allowed, mx.zeros((width - allowed.size,), dtype=mx.bool_)])
        return allowed[:width]
