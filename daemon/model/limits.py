"""What a request may ask of the loaded model: its vocabulary and context, and the configured caps.

Read from the checkpoint's config.json, so the transport can check requests before (and while)
the engine loads the weights.
"""

from __future__ import annotations

from pathlib import Path

from moed.daemon.config import ServeConfig
from moed.protocol import Limits
from moed.protocol.model_config import ModelConfig

UNKNOWN_CONTEXT_MAX_TOKENS = 8192  # the max_tokens limit of a checkpoint that names no context


def limits_for(serve: ServeConfig, model: ModelConfig) -> Limits:
    """The request limits of this model under this configuration (the smaller bound wins)."""
    context = model.context_tokens
    max_prompt = (
        serve.max_prompt_tokens if context is None else min(serve.max_prompt_tokens, context)
    )
    return Limits(
        vocab_size=model.vocab_size,
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
        model = ModelConfig.read(model_path)
    except (OSError, ValueError):
        model = ModelConfig.from_dict({})  # the load fails later with the real reason
    return limits_for(serve, model)
