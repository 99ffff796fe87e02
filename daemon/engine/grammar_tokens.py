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
_LONGEST_TOKEN_BYTES = 64  # no ordinary token is longer than this in the vocabularies moed meets


class MarkerTokens:
    """One tokenizer's special (non end-of-sequence) token ids, and its ordinary tokens by bytes
    (built on first need: a dead end is rare)."""

    def __init__(self, lltok: LLTokenizer, eos: list[int]):
        self.lltok = lltok
        size = lltok.vocab_size
        ends = set(eos)
        self.ids = np.array(
            [i for i in range(size) if lltok.is_special_token(i) and i not in ends],
            dtype=np.int64,
        )
        self._by_bytes: dict[bytes, int] | None = None

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
        """The longest ordinary token that begins the forced bytes and that `matcher` takes."""
        forced = bytes(matcher.compute_ff_bytes())
        if self._by_bytes is None:
            self._by_bytes = {}
            special = set(self.ids.tolist())
            for i in range(self.lltok.vocab_size):
                if i not in special and not self.lltok.is_special_token(i):
                    self._by_bytes.setdefault(self.lltok.decode_bytes([i]), i)
        for n in range(min(len(forced), _LONGEST_TOKEN_BYTES), 0, -1):
            token = self._by_bytes.get(forced[:n])
            if token is not None and matcher.validate_tokens([token]) == 1:
                return token
        return None


_MARKERS: weakref.WeakKeyDictionary[Any, MarkerTokens] = weakref.WeakKeyDictionary()


def marker_tokens(tokenizer: Any, lltok: LLTokenizer, eos: list[int]) -> MarkerTokens:
    """Built once per loaded tokenizer (a pass over the vocabulary), as its llguidance view."""
    cached = _MARKERS.get(tokenizer)
    if cached is None:
        cached = _MARKERS[tokenizer] = MarkerTokens(lltok, eos)
    return cached
