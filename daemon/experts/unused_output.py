"""Prompt chunks whose output nobody reads: the last layer's streamed experts sit them out.

mlx-lm's BatchGenerator keeps only the caches of a prompt chunk (mlx_compat.py, use 8): the model's
output of a call over several positions is built and dropped. Each layer's cache needs only the
layer's input, so the last decoder layer's experts feed nothing that is read. A streaming layer
routes eagerly (its router is read back to know what to read), so left alone it would compute
that layer's attention, read its missing experts and compute them for nothing: 1/L of a chunk's
expert reads. Inside `scope()`, the streaming switch of the model's last decoder layer returns
zeros for a call over several positions; a decode step (one position a row) is never skipped,
nor is any call while a request's router trace records (it shows the model's own routing).
"""

from __future__ import annotations

from moed.daemon.experts.engine_scope import EngineScope


class UnusedOutput(EngineScope):
    """Whether the current forward passes' output is unused (set by the engine, on its thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = 0  # last-layer calls skipped, for tests and benches
