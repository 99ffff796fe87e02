"""The grammars of waiting requests: each built on a grammar pool thread (engine/grammar_pool.py)
from the compile cache (engine/grammar_compile.py) and handed back to the engine thread as a
`GrammarReady` command, which lets the request join the batch or ends it with its refusal."""

from __future__ import annotations

from collections.abc import Callable

from moed.daemon.config import ServeConfig
from moed.daemon.engine.commands import EngineCommand, GrammarReady
from moed.daemon.engine.grammar_compile import GrammarCache, GrammarLimits
from moed.daemon.engine.grammar_pool import GrammarPool
from moed.daemon.engine.request import Generation, RequestKey


class RowGrammars:
    def __init__(self, serve: ServeConfig, post: Callable[[EngineCommand], None]):
        self.limits = GrammarLimits.from_serve(serve)
        self.cache = GrammarCache(self.limits.cache_entries)
        self._post = post
        self._pool: GrammarPool | None = None  # started at the first grammar
        self.timeouts = 0

    def start(self, gen: Generation) -> bool:
        """Queue the request's grammar for a pool thread; False when it asks for none."""
        if not gen.wants_grammar:
            return False
        if self._pool is None:
            post = self._post
            self._pool = GrammarPool(
                self.limits, lambda key, res: post(GrammarReady(key, res)), self._timed_out
            )
        self._pool.submit(gen.client, gen.job.key, gen.constraint_build(self.cache, self.limits))
        return True

    def _timed_out(self) -> None:
        self.timeouts += 1  # one pool thread at a time (the pool's timer)

    def stats(self) -> dict[str, int]:
        """Counters since the start, for `status` (`grammars`)."""
        return {
            "compiles": self.cache.compiles,
            "refused": self.cache.refused,
            "cache_hits": self.cache.hits,
            "timeouts": self.timeouts,
            "workers": self.limits.workers,
        }

    def cancel(self, key: RequestKey) -> None:
        """The request ended: its grammar, if still queued, is never built."""
        if self._pool is not None:
            self._pool.cancel(key)

    def close(self) -> None:
        """Stop the pool (a later grammar starts another) and drop what was compiled for this
        tokenizer (an unload too)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.cache.clear()
