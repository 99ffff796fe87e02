"""Position-keyed sampling: the random key of a token depends only on (seed, position).

mlx-lm's samplers draw from MLX's global random state, which concurrent generations share; keying
by position makes a seeded stream reproducible under interleaving and across a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


def greedy(logprobs: mx.array) -> mx.array:
    """Argmax per row; one shared function, so a batch of greedy requests samples in one call."""
    return mx.argmax(logprobs, axis=-1)


def make_position_sampler(
    params: SamplingParams, first_position: int, default_seed: int
) -> Callable[[mx.array], mx.array]:
    """A sampler for one request's rows, called once per position, in order."""
    if params.temperature == 0:
        return greedy
    seed = params.seed if params.seed is not None else default_seed
    position = first_position

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal position
        key = mx.random.key((seed * 1_000_003 + position) % (1 << 63))
        position += 1
        if params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=key)

    return sample
