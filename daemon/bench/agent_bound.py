"""The model's own floor under `moed bench agent`'s first ratio: plain mlx-lm in the bench's
process (no daemon running) reads the last turn's new tokens once after the context a prefix
cache holds (already in a KV cache) and once alone, as the bench's "new only" request sends them.

The new tokens attend to every cached one, so on a model whose attention is a large share of its
per-token compute (the demo model: hidden 128, 4 heads of 32; on MLX's CPU backend) the first is
several times the second whatever a cache does; no prefix cache can go below this ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from moed.daemon.model.chat_template import prompt_token_ids
from moed.protocol import GenerateRequest

REPEATS = 3  # each reading timed this many times, alternating, the median kept


@dataclass(frozen=True)
class ModelBound:
    after_context_s: float  # the new tokens read after the cached context, to the first token
    alone_s: float  # the new tokens read alone, to the first token

    @property
    def ratio(self) -> float:
        return self.after_context_s / self.alone_s


def measure_bound(model_path: Path, cases: list[tuple[str, int, str]], chunk: int) -> ModelBound:
    """`cases`: (the last turn's prompt, the tokens the daemon reused of it, its new text)."""
    # mlx on use: every `moed` command imports the bench modules
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = cast("tuple[Any, Any]", load(str(model_path)))  # typed 2- or 3-tuple

    def ids(text: str) -> list[int]:  # as the daemon tokenizes /v1/completions (raw text)
        return prompt_token_ids(tokenizer, GenerateRequest(prompt=text, raw=True))

    def read(context: list[int], new: list[int]) -> float:
        cache = make_prompt_cache(model)
        for at in range(0, len(context), chunk):
            model(mx.array([context[at : at + chunk]]), cache=cache)
            mx.eval([c.state for c in cache])
        t0 = time.perf_counter()
        for at in range(0, len(new) - 1, chunk):  # as mlx-lm reads a prompt: all but the last
            model(mx.array([new[:-1][at : at + chunk]]), cache=cache)
            mx.eval([c.state for c in cache])
        logits = model(mx.array([new[-1:]]), cache=cache)
        mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
        return time.perf_counter() - t0

    read([], ids("warm up"))  # first kernels out of the timings
    after, alone = [], []
    for prompt, cached, new_text in cases:
        tokens = ids(prompt)
        for _ in range(REPEATS):
            after.append(read(tokens[:cached], tokens[cached:]))
            alone.append(read([], ids(new_text)))
    return ModelBound(statistics.median(after), statistics.median(alone))
