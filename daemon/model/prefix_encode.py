"""Tokenizing a prompt that begins like an earlier one: only what follows their shared part is
encoded. An agent re-sends its whole conversation every turn, and tokenizing it again was the
largest cost in front of a turn with a prefix-cache hit (4-6 ms of a 3K-token turn's 12-14 ms from
the gateway's send to the engine; 27 ms at 20K tokens).

Exact by the tokenizer's own rules, at two kinds of cut:
- Before an added special token (one that strips nothing and is matched before normalization): a
  fast tokenizer splits its text at the added tokens first and encodes each piece alone, so the
  ids before such a token are the same whatever follows it (chat templates write them).
- After a newline and before an ASCII letter, for the byte-level BPE tokenizers whose
  pre-tokenizer is known (NEWLINE_SAFE_SPLITS: GPT-2's, Llama 3's, Qwen's): the text is split into
  pieces by a regex and each piece encoded alone, and under those regexes no piece holds both a
  newline and the letter after it (a letter run takes at most one non-newline character before
  it, a punctuation run takes trailing newlines but no letter, whitespace runs take no letter)
  and none looks behind; NFC composes nothing into an ASCII letter. So the pieces of the text
  after the cut are those of that text alone (raw prompts: completions, `moe run --raw`).
An earlier prompt's ids up to a cut, where both texts agree beyond it, are the new prompt's ids up
to there, and only the rest is encoded. A tokenizer with neither kind, or not a fast one, is
encoded whole. The first few reuses on each tokenizer are checked against a whole encoding; one
difference turns reuse off for that tokenizer for good, with a warning.
"""

from __future__ import annotations

import array
import bisect
import json
import logging
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("moed.tokenize")

ENTRIES = 8  # earlier prompts remembered per tokenizer: a few conversations at once
CHECKED_REUSES = 3  # reuses compared with a whole encoding before reuse is trusted
MIN_REUSE_CHARS = 256  # below this a shared start is not worth the bookkeeping
MIN_MARGIN = 8  # characters of the shared part kept past a cut (the regexes look one ahead)

# Split regexes (behavior Isolated) under which a newline cut is exact: Qwen2/Qwen3's, Qwen3.5's
# (letters with their marks) and Llama 3's (digits in threes). Matched as written: another
# regex's pieces are not known to add up, so its tokenizer gets no newline cuts.
NEWLINE_SAFE_SPLITS = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
_NEWLINE_CUT = re.compile(r"\n(?=[A-Za-z])")


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
    newline_cuts: bool  # the pre-tokenizer is one NEWLINE_SAFE_SPLITS knows
    adds_specials: bool  # encode(add_special_tokens=True) adds ids (a BOS) to any text
    backend_checked: bool = False  # its encode gave the tokenizer's own ids once
    checks_left: int = CHECKED_REUSES
    entries: list[_Encoded] = field(default_factory=list)


def _plan_for(tokenizer: Any) -> _TokenizerPlan | None:
    # mlx_compat imports mlx-lm (seconds); `moed bench agent` imports this module to start.
    from moed.daemon.model.mlx_compat import hf_tokenizer

    hf = hf_tokenizer(tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    added = getattr(hf, "added_tokens_decoder", None)
    if backend is None or not isinstance(added, dict) or not hasattr(backend, "encode"):
        return None
    splitting = {
        i: len(t.content)
        for i, t in added.items()
        if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
    }
    newline_cuts = _newline_cuts_exact(backend)
    if not splitting and not newline_cuts:
        return None
    margin = max([MIN_MARGIN, *(len(t.content) for t in added.values())])
    contents = tuple(sorted({added[i].content for i in splitting}))
    probe = "a"
    adds = len(hf.encode(probe, add_special_tokens=True)) != len(
        hf.encode(probe, add_special_tokens=False)
    )
    return _TokenizerPlan(backend, splitting, margin, contents, newline_cuts, adds)


def _newline_cuts_exact(backend: Any) -> bool:
    """Whether `backend` (a tokenizers.Tokenizer) is a byte-level BPE whose pieces never hold a
    newline and the ASCII letter after it (the module's second kind of cut)."""
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # not a tokenizers.Tokenizer (or one that cannot say): no such cuts
        return False
    if (spec.get("model") or {}).get("type") != "BPE":
        return False
    if spec.get("normalizer") not in (None, {"type": "NFC"}):
        return False
    pre = spec.get("pre_tokenizer") or {}
    steps: list[Any] = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    byte_level = steps[-1] if steps else {}
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space", True):
        return False
    if len(steps) == 1:  # GPT-2's own regex
        return bool(byte_level.get("use_regex", True))
    if len(steps) != 2 or byte_level.get("use_regex", True):
        return False
    split = steps[0]
    return (
        split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and not split.get("invert", False)
        and (split.get("pattern") or {}).get("Regex") in NEWLINE_SAFE_SPLITS
    )


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

    def encode(self, tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=...)`, reusing an earlier prompt's ids."""
        plan = self._plan(tokenizer)
        if plan is None or (add_special_tokens and plan.adds_specials):
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
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
        cuts = []
        for char in _occurrences(tail, plan.contents):  # found by C-speed search, not per id
            j = enc.char_to_token(char)
            if j is not None and ids[j] in plan.splitting and enc.token_to_chars(j)[0] == char:
                cuts.append((start + char, len(prefix_ids) + j))
        if plan.newline_cuts:
            for m in _NEWLINE_CUT.finditer(tail):
                # A token starts at the letter: the cut is no added token's inside.
                j = enc.char_to_token(m.end())
                if j is not None and enc.token_to_chars(j)[0] == m.end():
                    cuts.append((start + m.end(), len(prefix_ids) + j))
        cuts.sort()
        cut_chars = list(prefix_cuts[0]) + [c for c, _ in cuts]
        cut_ids = list(prefix_cuts[1]) + [i for _, i in cuts]
        return _Encoded(text, prefix_ids + array.array("q", ids), cut_chars, cut_ids)


def _whole(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))
