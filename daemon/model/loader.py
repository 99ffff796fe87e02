"""Loading a model for the daemon: lazily with mlx-lm, the experts swapped for streaming twins,
then only the resident weights materialized, after the memory plan agreed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import mlx_lm.utils
from mlx.utils import tree_flatten

from moed.daemon.config import ServeConfig
from moed.daemon.experts.active_experts import ActiveExpertsError, limit_active_experts
from moed.daemon.experts.budget import parse_size
from moed.daemon.experts.install import install_streaming
from moed.daemon.experts.memory_plan import estimate_kv_bytes
from moed.daemon.experts.streaming_config import StreamingConfig
from moed.daemon.model.demo import demo_model_path
from moed.daemon.model.pipeline_group import PipelineGroup
from moed.protocol.model_config import ModelConfig

if TYPE_CHECKING:  # types only: loading them would import mlx before it is needed
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from moed.daemon.experts.active_experts import Routing
    from moed.daemon.experts.streamer import ExpertStreamer

log = logging.getLogger("moed.engine")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: what mlx-lm loaded, with its experts streamed unless resident."""

    # mlx-lm's model; on rank 0 of a pipeline, the leader that stands in for it (same calls).
    model: nn.Module | PipelineGroup
    tokenizer: TokenizerWrapper  # mlx-lm's wrapper: detokenizer, chat template, markers
    path: Path
    config: ModelConfig  # the checkpoint's config.json, parsed once
    streamer: ExpertStreamer | None  # None when resident
    pipeline: PipelineGroup | None = None  # when this daemon is rank 0 of a pipeline group
    routing: Routing | None = None  # experts per token, native and active


# (stage, done, total, unit): how far a load is, for `status` and for a client waiting on a reload.
LoadProgress = Callable[[str, float, float, str], None]


def load_model(
    serve: ServeConfig, path: Path, on_progress: LoadProgress | None = None
) -> LoadedModel:
    """Load the whole model in this process lazily, swap in the streaming experts, then
    materialize only what stays resident (a pipeline's rank 0 loads through distributed/rank0)."""
    report = on_progress or (lambda *_: None)
    report("reading the checkpoint", 0, 1, "steps")
    # mlx-lm's load is typed as either tuple; return_config=True makes it the three.
    model, tokenizer, raw = cast(
        "tuple[nn.Module, TokenizerWrapper, dict[str, Any]]",
        mlx_lm.utils.load(str(path), lazy=True, return_config=True),
    )
    config = ModelConfig.from_dict(raw)
    check_tokenizer(tokenizer, config)
    routing = limit_routing(model, config, serve.max_active_experts)
    streamer = None
    if not serve.resident:
        streamer = install_streaming(model, path, streaming_config(serve, config))
        if not streamer.plan.fits:
            streamer.close()
            raise MemoryPlanRefused(streamer.plan.refusal())
    materialize(model, report)
    if streamer is not None:
        report("warming the expert cache", 0, 1, "steps")
        warmed = streamer.warm()  # the experts the saved usage profile found hot
        log.info("expert cache warmed with %d bytes from the usage profile", warmed)
    report("ready", 1, 1, "steps")
    return LoadedModel(model, tokenizer, path, config, streamer, routing=routing)


def limit_routing(model: Any, config: ModelConfig, max_active_experts: int) -> Routing | None:
    """The model's experts per token, reduced to `max_active_experts` when that is set (lossy)."""
    native = config.experts_per_token
    if native is None:
        if max_active_experts:
            raise ActiveExpertsError(
                "max_active_experts is set but the checkpoint names no experts per token "
                "(num_experts_per_tok): not a Mixture-of-Experts model moed can reduce"
            )
        return None
    return limit_active_experts(model, native, max_active_experts)


# Resident weights are evaluated in about this many batches, each a progress report.
LOAD_STEPS = 20


def materialize(model: Any, report: LoadProgress) -> None:
    """Evaluate the resident weights in batches (the same arrays as one mx.eval of all of them),
    reporting bytes as they land."""
    # tree_flatten is typed as a list or a dict; without a `destination` it is the list.
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    arrays = [a for _, a in flat]
    total = sum(a.nbytes for a in arrays)  # from shapes: no evaluation
    step = max(total // LOAD_STEPS, 1)
    done, batch_bytes = 0, 0
    batch: list[mx.array] = []
    report("loading weights", 0, total, "bytes")
    for i, array in enumerate(arrays):
        batch.append(array)
        batch_bytes += array.nbytes
        if batch_bytes >= step or i == len(arrays) - 1:
            mx.eval(batch)
            done += batch_bytes
            batch, batch_bytes = [], 0
            report("loading weights", done, total, "bytes")


def streaming_config(serve: ServeConfig, model_config: ModelConfig) -> StreamingConfig:
    """The expert-streaming settings of a daemon configuration, with room for its KV cache."""
    return StreamingConfig(
        cache_budget=serve.cache_budget,
        prefetch_workers=serve.prefetch_workers,
        page_cache=serve.page_cache,
        state_dir=serve.state_dir,
        prefetch_next=serve.prefetch_next,
        lookahead=serve.lookahead,
        cache_policy=serve.cache_policy,
        memory_bytes=serve.memory_limit_bytes,
        kv_bytes=estimate_kv_bytes(model_config, serve.plan_context_tokens),
        prefix_cache_bytes=prefix_cache_memory_bytes(serve),
    )


def prefix_cache_memory_bytes(serve: ServeConfig) -> int | None:
    """The prefix cache's memory tier as the plan counts it: None for the plan's automatic share
    (under a pipeline, a set size is the whole group's: each rank plans for its layers' share)."""
    return None if serve.prefix_cache_bytes == "auto" else parse_size(serve.prefix_cache_bytes)


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer alone (`count_tokens` while the model is unloaded)."""
    return mlx_lm.utils.load_tokenizer(path)


class CheckpointUnusable(RuntimeError):
    """The checkpoint loads but cannot serve a prompt (no tokenizer): refused at load."""


def check_tokenizer(tokenizer: Any, config: ModelConfig) -> None:
    """Text must tokenize to ids the embedding holds, or every prompt would fail later."""
    try:
        ids = list(tokenizer.encode("Hello, world.", add_special_tokens=False))
    except Exception as exc:
        raise CheckpointUnusable(f"the checkpoint's tokenizer cannot encode text: {exc}") from exc
    if not ids:
        raise CheckpointUnusable(
            "the checkpoint's tokenizer encodes text to nothing (tokenizer.json missing or empty?)"
        )
    vocab = config.vocab_size
    if vocab is not None and max(ids) >= vocab:
        raise CheckpointUnusable(
            f"the checkpoint's tokenizer gives id {max(ids)}, "
            f"outside the model's vocabulary ({vocab})"
        )


class MemoryPlanRefused(RuntimeError):
    """The memory plan says the model cannot fit: refuse before it can crash the process."""


def describe_model(loaded: LoadedModel) -> dict[str, Any]:
    cfg = loaded.config
    return {
        "path": str(loaded.path),
        "name": loaded.path.name,
        "model_type": cfg.model_type,
        "num_layers": cfg.num_layers,
        "quantization": dict(cfg.quantization) if cfg.quantization is not None else None,
        "streaming": loaded.streamer is not None,
        **(loaded.routing.describe() if loaded.routing is not None else {}),
        "chat_template": bool(getattr(loaded.tokenizer, "has_chat_template", False)),
        # The template's markers mlx-lm found: tool calls cut out, reasoning as its own channel.
        "tool_calling": bool(getattr(loaded.tokenizer, "has_tool_calling", False)),
        "thinking": bool(getattr(loaded.tokenizer, "has_thinking", False)),
        # The embedded demo model: clients say what its text is (a toy, see MODEL_CARD.md).
        "demo": loaded.path.resolve() == demo_model_path().resolve(),
    }
