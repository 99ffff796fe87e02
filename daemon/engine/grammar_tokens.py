"""The model's marker tokens in a grammar's mask.

llguidance keeps added tokens (Qwen's `<think>`, `</think>`, `<tool_call>`, ...) apart from text:
a grammar matches one only by its id (`<[id]>`), never by its spelling. Yet where the grammar
forces text that spells one (a `const: "<think>"`), its mask offers that token, the canonical
tokenization of the forced bytes, and then refuses to consume it: the answer met a dead end and
ended as broken JSON. Such a token is taken out of the mask, and where nothing is left, the first
ordinary token of the forced text is offered instead.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # types only: llguidance is imported where a grammar is built
    from llguidance import LLMatcher, LLTokenizer

_MASK_BITS = 32  # bit i of a mask word is token 32 * word + i


class MarkerTokens:
    """One tokenizer's special (non end-of-sequence) token ids."""

    def __init__(self, lltok: LLTokenizer, eos: list[int]):
        self.lltok = lltok
        size = lltok.vocab_size
        ends = set(eos)
        self.ids = np.array(
            [i for i in range(size) if lltok.is_special_token(i) and i not in ends],
            dtype=np.int64,
        )

    def fix(self, matcher: LLMatcher, words: np.ndarray) -> np.ndarray:
        """The packed mask without the marker tokens `matcher` would refuse; with an ordinary
        token for the forced text where that leaves nothing."""
        if not self.ids.size:
            return words
        offered = self.ids[(words[self.ids // _MASK_BITS] >> (self.ids % _MASK_BITS)) & 1 == 1]
        refused = [int(t) for t in offered if matcher.validate_tokens([int(t)]) == 0]
        if not refused:
            return words
        words = words.copy()
        for token in refused:
            words[token // _MASK_BITS] &= ~np.uint32(1 << (token % _MASK_BITS))
        spelling = None if words.any() else self._spelling(matcher)
        if spelling is not None:
            words[spelling // _MASK_BITS] |= np.uint32(1 << (spelling % _MASK_BITS))
        return words

    def _spelling(self, matcher: LLMatcher) -> int | None:
        """The first ordinary token of the forced text (llguidance's greedy tokenizer matches no
        marker token), if `matcher` takes it."""
        forced = bytes(matcher.compute_ff_bytes()).decode("utf-8", errors="ignore")
        tokens = self.lltok.greedy_tokenize(forced) if forced else []
        if tokens and matcher.validate_tokens(tokens[:1]) == 1:
            return int(tokens[0])
        return None


_MARKERS: weakref.WeakKeyDictionary[Any, MarkerTokens] = weakref.WeakKeyDictionary()


def marker_tokens(tokenizer: Any, lltok: LLTokenizer, eos: list[int]) -> MarkerTokens:
    """Built once per loaded tokenizer (a pass over the vocabulary), as its llguidance view."""
    cached = _MARKERS.get(tokenizer)
    if cached is None:
        cached = _MARKERS[tokenizer] = MarkerTokens(lltok, eos)
    return cached
