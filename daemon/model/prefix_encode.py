"""Tokenizing a chat prompt that begins like an earlier one: only what follows their shared part is
encoded. An agent re-sends its whole conversation every turn, and tokenizing it again was the
largest cost in front of a turn with a prefix-cache hit (4-6 ms of a 3K-token turn's 12-14 ms from
the gateway's send to the engine; 27 ms at 20K tokens).

Exact by the tokenizer's own rule: a fast tokenizer splits its text at the added tokens first, and
encodes each piece between them alone. So the ids of the text before an added special token
(one that strips nothing and is matched before normalization) are the same whatever follows it:
an earlier prompt's ids up to such a token, where both texts agree beyond it, are the new
prompt's ids up to there, and only the rest is encoded. A tokenizer without such tokens, or not a
fast one, is encoded whole. The first few reuses on each tokenizer are checked against a whole
encoding; one difference turns reuse off for that tokenizer for good, with a warning.
"""

from __future__ import annotations

import array
import bisect
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("moed.tokenize")

ENTRIES = 8  # earlier prompts remembered per tokenizer: a few conversations at once
CHECKED_REUSES = 3  # reuses compared with a whole encoding before reuse is trusted
MIN_REUSE_CHARS = 256  # below this a shared start is not worth the bookkeeping


@dataclass
class _Encoded:
    text: str
    ids: array.array[int]  # 8-byte ints: a 20K-token prompt's are 160 kB, not 0.7 MB of objects
    cut_chars: list[int]  # where a splitting special token starts, ascending
    cut_ids: list[int]  # the index of its id in `ids`


@dataclass
class _TokenizerPlan:
    backend: Any  # tokenizers.Tokenizer: gives each token's character offsets
    splitting: dict[int, int]  # a splitting special token's id -> its length in characters
    margin: int  # the longest added token: a cut this far inside the shared part is safe
    contents: tuple[str, ...]  # the splitting tokens' texts
    backend_checked: bool = False  # its encode gave the tokenizer's own ids once
    checks_left: int = CHECKED_REUSES
    entries: list[_Encoded] = field(default_factory=list)


def _plan_for(tokenizer: Any) -> _TokenizerPlan | None:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    added = getattr(hf, "added_tokens_decoder", None)
    if backend is None or not isinstance(added, dict) or not hasattr(backend, "encode"):
        return None
    splitting = {
        i: len(t.content)
        for i, t in added.items()
        if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
    }
    if not splitting:
        return None
    margin = max(len(t.content) for t in added.values())
    contents = tuple(sorted({added[i].content for i in splitting}))
    return _TokenizerPlan(backend, splitting, margin, contents)


def _occurrences(text: str, contents: tuple[str, ...]) -> list[int]:
    """Where any of `contents` starts in `text`, ascending."""
    found = []
    for content in contents:
        at = text.find(content)
        while at >= 0:
            found.append(at)
            at = text.find(content, at + len(content))
    return sorted(found)


def _common_prefix(a: str, b: str) -> int:
    """The length of a and b's common start, by bisection: one slice and a C-speed compare per
    halving (a char loop over a 20K-token conversation costs more than encoding it)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixEncoder:
    def __init__(self, entries: int = ENTRIES) -> None:
        self._entries = entries
        self._lock = threading.Lock()  # the transport thread and the engine thread both encode
        self._plans: weakref.WeakKeyDictionary[Any, _TokenizerPlan | None] = (
            weakref.WeakKeyDictionary()
        )

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`, reusing an earlier prompt's ids."""
        plan = self._plan(tokenizer)
        if plan is None:
            return _whole(tokenizer, text)
        with self._lock:
            start, prefix_ids, prefix_cuts = self._reusable(plan, text)
        if start == 0:
            encoded = self._encode_from(plan, text, 0, array.array("q"), ([], []))
            if not plan.backend_checked:
                whole = _whole(tokenizer, text)
                if encoded.ids.tolist() != whole:
                    self._give_up(tokenizer, "its fast tokenizer's ids differ from its encode's")
                    return whole
                plan.backend_checked = True
        else:
            encoded = self._encode_from(plan, text, start, prefix_ids, prefix_cuts)
            if plan.checks_left > 0:
                whole = _whole(tokenizer, text)
                if encoded.ids.tolist() != whole:
                    self._give_up(tokenizer, f"a reuse cut at character {start} changed the ids")
                    return whole
                plan.checks_left -= 1
        with self._lock:
            plan.entries = [e for e in plan.entries if e.text != text][-(self._entries - 1) :]
            plan.entries.append(encoded)
        return encoded.ids.tolist()

    def clear(self) -> None:
        with self._lock:
            for plan in self._plans.values():
                if plan is not None:
                    plan.entries.clear()

    def _plan(self, tokenizer: Any) -> _TokenizerPlan | None:
        with self._lock:
            try:
                if tokenizer in self._plans:
                    return self._plans[tokenizer]
                plan = _plan_for(tokenizer)
                self._plans[tokenizer] = plan
                return plan
            except TypeError:  # a tokenizer that cannot be weakly referenced: encode whole
                return None

    def _give_up(self, tokenizer: Any, why: str) -> None:
        log.warning("tokenizing whole prompts from now on for this tokenizer: %s", why)
        with self._lock:
            self._plans[tokenizer] = None

    def _reusable(
        self, plan: _TokenizerPlan, text: str
    ) -> tuple[int, array.array[int], tuple[list[int], list[int]]]:
        """The latest cut shared with an earlier prompt: (its character, the ids before it, the
        cuts before it)."""
        best: tuple[int, _Encoded, int] | None = None
        for entry in plan.entries:
            shared = _common_prefix(entry.text, text)
            # The whole special token and an added token's length beyond it lie in the shared
            # part: the new text splits there exactly as the old one did.
            i = bisect.bisect_right(entry.cut_chars, shared - 2 * plan.margin) - 1
            if i >= 0 and entry.cut_chars[i] >= MIN_REUSE_CHARS:
                if best is None or entry.cut_chars[i] > best[0]:
                    best = (entry.cut_chars[i], entry, i)
        if best is None:
            return 0, array.array("q"), ([], [])
        char, entry, i = best
        return (
            char,
            entry.ids[: entry.cut_ids[i]],
            (entry.cut_chars[:i], entry.cut_ids[:i]),
        )

    def _encode_from(
        self,
        plan: _TokenizerPlan,
        text: str,
        start: int,
        prefix_ids: array.array[int],
        prefix_cuts: tuple[list[int], list[int]],
    ) -> _Encoded:
        tail = text[start:]
        enc = plan.backend.encode(tail, add_special_tokens=False)
        ids = enc.ids
        cut_chars, cut_ids = list(prefix_cuts[0]), list(prefix_cuts[1])
        for char in _occurrences(tail, plan.contents):  # found by C-speed search, not per id
            j = enc.char_to_token(char)
            if j is not None and ids[j] in plan.splitting and enc.token_to_chars(j)[0] == char:
                cut_chars.append(start + char)
                cut_ids.append(len(prefix_ids) + j)
        return _Encoded(text, prefix_ids + array.array("q", ids), cut_chars, cut_ids)


def _whole(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))
