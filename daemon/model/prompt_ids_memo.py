"""The last few prompts' token ids, shared by the transport's `count_tokens` and the engine's
admission: a gateway counts a prompt (to answer an over-long one in its API's words) right before
it sends the same prompt to generate, and an agent's prompt of 20K+ tokens took 27 ms to tokenize
on this 2-core machine, twice a turn.

Keyed by what decides the ids (the prompt fields of the request) and the tokenizer itself, held
weakly: an entry is never used with another tokenizer, even one at a recycled address.
"""

from __future__ import annotations

import array
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from moed.protocol import GenerateRequest

ENTRIES = 8  # a few clients' turns at once; each entry holds one prompt's text and ids


def prompt_key(req: GenerateRequest) -> str:
    """The request's fields that decide its prompt's ids, as one string."""
    return json.dumps(
        [
            req.prompt,
            req.messages,
            req.template_tools,
            req.chat_template_kwargs,
            bool(req.raw),
        ],
        separators=(",", ":"),
        default=repr,  # a field of another type still keys by its value, never by chance
    )


class PromptIdsMemo:
    def __init__(self, entries: int = ENTRIES) -> None:
        self._entries = entries
        self._lock = threading.Lock()  # the transport thread and the engine thread both ask
        # ids as 8-byte ints: a 24K-token prompt's are 192 kB, not a megabyte of Python ints
        self._memo: OrderedDict[str, tuple[weakref.ref[Any], array.array[int]]] = OrderedDict()

    def ids(
        self, tokenizer: Any, req: GenerateRequest, encode: Callable[[], list[int]]
    ) -> list[int]:
        """`encode()`'s ids for `req`, computed once per tokenizer while remembered."""
        key = prompt_key(req)
        with self._lock:
            hit = self._memo.get(key)
            if hit is not None and hit[0]() is tokenizer:
                self._memo.move_to_end(key)
                return list(hit[1])
        ids = encode()
        with self._lock:
            self._memo[key] = (weakref.ref(tokenizer), array.array("q", ids))
            self._memo.move_to_end(key)
            while len(self._memo) > self._entries:
                self._memo.popitem(last=False)
        return ids

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
