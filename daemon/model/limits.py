"""What a request may ask of the loaded model: its vocabulary and context, and the configured caps.

Read from the checkpoint's config.json, so the transport can check requests before (and while)
the engine loads the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from moed.daemon.config import ServeConfig
from moed.protocol import Limits

UNKNOWN_CONTEXT_MAX_TOKENS = 8192  # the max_tokens limit of a checkpoint that names no context


def _model_value(config: dict, key: str) -> int | None:
    text_config = config.get("text_config")
    for table in (config, text_config if isinstance(text_config, dict) else {}):
        value = table.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def limits_for(serve: ServeConfig, model_config: dict) -> Limits:
    """The request limits of this model under this configuration (the smaller bound wins)."""
    context = _model_value(model_config, "max_position_embeddings")
    max_prompt = (
        serve.max_prompt_tokens if context is None else min(serve.max_prompt_tokens, context)
    )
    return Limits(
        vocab_size=_model_value(model_config, "vocab_size"),
        context_tokens=context,
        max_prompt_tokens=max_prompt,
        # Unset, a generation may run to the end of the context: agents ask for 32K tokens.
        max_tokens=serve.max_tokens_limit or context or UNKNOWN_CONTEXT_MAX_TOKENS,
        default_max_tokens=serve.default_max_tokens,
        telemetry_every=serve.telemetry_every,
    )


def read_limits(serve: ServeConfig, model_path: Path) -> Limits:
    """Limits from the checkpoint on disk; an unreadable config leaves only the configured caps."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}  # the load fails later with the real reason
    return limits_for(serve, config if isinstance(config, dict) else {})
