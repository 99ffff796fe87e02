"""Per-token log probabilities for the APIs that return them: the chosen token's and the top k."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def token_logprobs(logprobs: mx.array, token: int, top: int, tokenizer: Any) -> dict:
    """{id, token, logprob, top: [{id, token, logprob}, ...]} for one sampled position."""
    logprobs = logprobs.reshape(-1)
    entry = {
        "id": token,
        "token": tokenizer.decode([token]),
        "logprob": float(logprobs[token].item()),
        "top": [],
    }
    if top > 0:
        ids = mx.argpartition(-logprobs, top - 1)[:top]
        values = logprobs[ids]
        order = mx.argsort(-values)
        for i, lp in zip(ids[order].tolist(), values[order].tolist()):
            entry["top"].append({"id": i, "token": tokenizer.decode([i]), "logprob": float(lp)})
    return entry
