"""Loading a model for the daemon: lazily with mlx-lm, the experts swapped for streaming twins,
then only the resident weights materialized, after the memory plan agreed."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moed.daemon.config import ServeConfig

log = logging.getLogger("moed.engine")


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    config: dict
    streamer: Any  # ExpertStreamer or None when resident
    pipeline: Any = None  # PipelineLeader when this daemon is rank 0 of a pipeline group


def load_model(serve: ServeConfig, path: Path) -> LoadedModel:
    """Load lazily, swap in the streaming experts, then materialize only what stays resident."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from moed.daemon.distributed.spec import pipeline_enabled

    if pipeline_enabled(serve):  # this daemon is rank 0: its layers only, the group follows
        from moed.daemon.distributed.rank0 import load_leader

        return load_leader(serve, path)
    model, tokenizer, config = load(str(path), lazy=True, return_config=True)
    streamer = None
    if not serve.resident:
        from moed.daemon.experts import install_streaming

        streamer = install_streaming(model, path, streaming_config(serve, config))
        if not streamer.plan.fits:
            streamer.close()
            raise MemoryPlanRefused(streamer.plan.refusal())
    mx.eval(model.parameters())
    if streamer is not None:
        warmed = streamer.warm()  # the experts the saved usage profile found hot
        log.info("expert cache warmed with %d bytes from the usage profile", warmed)
    return LoadedModel(model, tokenizer, path, config, streamer)


def streaming_config(serve: ServeConfig, model_config: dict):
    """The expert-streaming settings of a daemon configuration, with room for its KV cache."""
    from moed.daemon.experts import StreamingConfig, estimate_kv_bytes

    return StreamingConfig(
        cache_budget=serve.cache_budget,
        prefetch_workers=serve.prefetch_workers,
        page_cache=serve.page_cache,
        state_dir=serve.state_dir,
        prefetch_next=serve.prefetch_next,
        cache_policy=serve.cache_policy,
        memory_bytes=serve.memory_limit_bytes,
        kv_bytes=estimate_kv_bytes(model_config, serve.plan_context_tokens),
    )


class MemoryPlanRefused(RuntimeError):
    """The memory plan says the model cannot fit: refuse before it can crash the process."""


def describe_model(loaded: LoadedModel) -> dict:
    cfg = loaded.config
    text_cfg = cfg.get("text_config", {}) if isinstance(cfg.get("text_config"), dict) else {}
    return {
        "path": str(loaded.path),
        "name": loaded.path.name,
        "model_type": cfg.get("model_type"),
        "num_layers": cfg.get("num_hidden_layers") or text_cfg.get("num_hidden_layers"),
        "quantization": cfg.get("quantization"),
        "streaming": loaded.streamer is not None,
        "chat_template": bool(getattr(loaded.tokenizer, "has_chat_template", False)),
    }
