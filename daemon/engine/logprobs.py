"""Per-token log probabilities for the APIs that return them: the chosen token's and the top k."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx


def token_logprobs(logprobs: mx.array, token: int, top: int, tokenizer: Any) -> dict[str, Any]:
    """{id, token, logprob, top: [{id, token, logprob}, ...]} for one sampled position."""
    logprobs = logprobs.reshape(-1)
    entry = {
        "id": token,
        "token": tokenizer.decode([token]),
        "logprob": float(logprobs[token].item()),  # type: ignore[arg-type]  # mlx types item() int/float/complex
        "top": [],
    }
    if top > 0:
        ids = mx.argpartition(-logprobs, top - 1)[:top]
        values = logprobs[ids]
        order = mx.argsort(-values)
        # tolist() of a 1-d array is a list (mlx types it list or scalar)
        top_ids = cast(list[int], ids[order].tolist())
        top_values = cast(list[float], values[order].tolist())
        for i, lp in zip(top_ids, top_values):
            entry["top"].append({"id": i, "token": tokenizer.decode([i]), "logprob": float(lp)})
    return entry
