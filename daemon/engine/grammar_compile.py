"""A request's grammar compiled once, within bounds: the grammar's source is at most
`max_schema_bytes`, llguidance's own limits hold its compile and each mask step, and what a
source compiled to (a matcher, or the refusal) is kept by the source's hash, so a schema sent
again is not compiled again, whether it compiled or was refused.

Runs on the grammar pool's threads (engine/grammar_pool.py), never on the engine's: llguidance
builds a matcher with the GIL released, so the engine keeps stepping the other rows meanwhile.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moed.daemon.config import ServeConfig
from moed.daemon.engine.grammar import explained
from moed.protocol import ErrorCode, ProtocolError

if TYPE_CHECKING:  # types only: llguidance is imported where a grammar is built
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

CACHE_ENTRIES = 32  # compiled grammars and refusals kept (a large grammar's matcher holds MBs)
CacheKey = tuple[int, bytes]


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost (built once from the serve settings)."""

    workers: int  # compile threads
    max_source_bytes: int  # the grammar's source (the schema or the tools' grammar), UTF-8
    timeout_s: float  # a compile still running then ends its request with schema_too_complex
    cache_entries: int = CACHE_ENTRIES

    @classmethod
    def from_serve(cls, serve: ServeConfig) -> GrammarLimits:
        return cls(serve.grammar_workers, serve.max_schema_bytes, serve.grammar_timeout_s)

    def parser_limits(self) -> LLParserLimits:
        from llguidance import LLParserLimits

        # llguidance's defaults bound the work (lexer fuel per compile and per mask, grammar
        # symbols, lexer states); its errors stay short (the default repeats the whole grammar).
        return LLParserLimits(verbose_errors=False)


def too_complex(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.SCHEMA_TOO_COMPLEX, message)


def check_size(source: str, limits: GrammarLimits) -> None:
    size = len(source.encode())
    if size > limits.max_source_bytes:
        raise too_complex(
            f"the grammar of this request's schema or tools is {size} bytes, over the daemon's "
            f"max_schema_bytes ({limits.max_source_bytes})"
        )


def compile_matcher(lltok: LLTokenizer, source: str, limits: GrammarLimits) -> LLMatcher:
    """A fresh matcher of `source`, its first mask computed (the lexer's first states are built
    here rather than in the first decode step); a grammar llguidance refuses is
    `invalid_schema`."""
    from llguidance import LLMatcher

    matcher = LLMatcher(lltok, source, log_level=0, limits=limits.parser_limits())
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        why = explained(matcher.get_error())
        raise ProtocolError(ErrorCode.INVALID_SCHEMA, f"the grammar does not compile: {why}")
    return matcher


class GrammarCache:
    """Compiled matchers and refusals by (tokenizer, hash of the source), least recently used
    out first. A matcher here is never advanced: each request gets its own deep copy. A source
    that is compiling now is compiled once: the others asking for it wait for its outcome."""

    def __init__(self, entries: int):
        self.entries = entries
        self._lock = threading.Lock()
        self._items: OrderedDict[CacheKey, tuple[Any, LLMatcher | ProtocolError]] = OrderedDict()
        self._compiling: dict[CacheKey, threading.Event] = {}
        self.hits = 0
        self.compiles = 0
        self.refused = 0  # compiles that ended in a refusal

    @staticmethod
    def key(lltok: LLTokenizer, source: str) -> CacheKey:
        # The tokenizer is held by its entries, so its id cannot be reused while they live.
        return (id(lltok), hashlib.sha256(source.encode()).digest())

    def get_or_compile(
        self, key: CacheKey, lltok: LLTokenizer, compile: Callable[[], LLMatcher]
    ) -> LLMatcher | ProtocolError:
        """The cached outcome of `key`, or `compile()`'s (a ProtocolError it raises is kept as
        the outcome)."""
        while True:
            with self._lock:
                item = self._items.get(key)
                if item is not None:
                    self._items.move_to_end(key)
                    self.hits += 1
                    return item[1]
                running = self._compiling.get(key)
                if running is None:
                    done = self._compiling[key] = threading.Event()
            if running is not None:
                running.wait()  # bounded by llguidance's limits; then the outcome is cached
                continue
            try:
                value: LLMatcher | ProtocolError = compile()
            except ProtocolError as exc:
                value = exc
            except BaseException:  # a bug: the waiters try again themselves
                with self._lock:
                    del self._compiling[key]
                done.set()
                raise
            with self._lock:
                del self._compiling[key]
                self._items[key] = (lltok, value)
                while len(self._items) > self.entries:
                    self._items.popitem(last=False)
                self.compiles += 1
                self.refused += isinstance(value, ProtocolError)
            done.set()
            return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def cached_matcher(
    cache: GrammarCache, lltok: LLTokenizer, source: str, limits: GrammarLimits
) -> LLMatcher:
    """A matcher of its own for one request: a copy of the cached one, or compiled (and cached,
    as is a refusal) now."""
    check_size(source, limits)
    found = cache.get_or_compile(
        cache.key(lltok, source), lltok, lambda: compile_matcher(lltok, source, limits)
    )
    if isinstance(found, ProtocolError):
        raise ProtocolError(found.code, found.message)
    return found.deep_copy()
