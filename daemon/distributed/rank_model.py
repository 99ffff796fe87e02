"""Load one rank's share of a model: its layers' non-expert weights resident, its layers' experts
streamed within its own budget, with mlx-lm's PipelineMixin doing the split and the activations."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import load

from moed.daemon.distributed.split import (
    SplitMode,
    balanced_split,
    check_split,
    even_split,
    layer_costs,
)
from moed.daemon.experts import CheckpointIndex, install_streaming
from moed.daemon.model.layer_caches import trimmable_layers
from moed.daemon.model.loader import MemoryPlanRefused
from moed.daemon.model.mlx_compat import pipeline_layers, pipelined_architectures
from moed.protocol.model_config import ModelConfig

log = logging.getLogger("moed.distributed")


class PipelineUnsupported(ValueError):
    """The architecture has no pipeline support in the installed mlx-lm."""


@dataclass(frozen=True)
class RankLayers:
    rank: int
    size: int
    start: int  # first decoder layer this rank runs
    end: int  # one past its last
    num_layers: int  # in the whole model
    split: tuple[int, ...]  # layers per rank, rank 0 first

    @property
    def share(self) -> float:
        """This rank's share of the layers (of a byte budget set for the whole model)."""
        return (self.end - self.start) / self.num_layers


@dataclass(frozen=True)
class RankModel:
    model: Any  # the mlx-lm model, cut to this rank's layers
    tokenizer: Any
    config: ModelConfig
    path: Path
    streamer: Any  # ExpertStreamer over this rank's layers, or None when resident
    layers: RankLayers
    pipeline: nn.Module  # the PipelineMixin module (model.model, or language_model.model)
    resident_weight_bytes: int  # this rank's non-expert weights
    # Per decoder layer of the whole model, whether its cache can be cut back (the prefix cache:
    # rank 0 resumes the others' layers too).
    layer_trimmable: tuple[bool, ...] = ()


def pipeline_module(model: nn.Module) -> nn.Module | None:
    """The module that carries mlx-lm's PipelineMixin, if the architecture has one."""
    for owner in (model, getattr(model, "language_model", None)):
        inner = getattr(owner, "model", None) if owner is not None else None
        if inner is not None and callable(getattr(inner, "pipeline", None)):
            return inner
    return None


def num_layers(path: Path) -> int:
    """The decoder layers a checkpoint names: what a pipeline's split divides."""
    layers = ModelConfig.read(path).num_layers
    if layers is None:
        raise PipelineUnsupported(f"{path}/config.json names no num_hidden_layers to split")
    return layers


def refuse_unsupported(model: nn.Module, config: ModelConfig) -> nn.Module:
    inner = pipeline_module(model)
    if inner is None:
        kind = config.model_type or type(model).__module__
        raise PipelineUnsupported(
            f"model type {kind!r} has no pipeline support in mlx-lm {mlx_lm.__version__} "
            f"(no PipelineMixin); run it in one process, or use one of: "
            f"{', '.join(pipelined_architectures())}"
        )
    return inner


def resolve_split(
    split: tuple[int, ...] | SplitMode,
    size: int,
    path: Path,
    config: ModelConfig,
    num_layers: int,
) -> tuple[int, ...]:
    if isinstance(split, tuple):
        check_split(split, size, num_layers)
        return split
    if split is SplitMode.COST:
        top_k = config.experts_per_token or 1
        costs = layer_costs(CheckpointIndex(path), num_layers, top_k)
        return balanced_split([c.per_token_bytes for c in costs], size)
    return even_split(size, num_layers)


def _switch_param_bytes(model: nn.Module) -> int:
    return sum(
        v.nbytes
        for _, m in model.named_modules()
        if isinstance(m, (SwitchGLU, SwitchMLP))
        for _, v in tree_flatten(m.parameters())
    )


def load_rank_model(
    path: Path,
    group: mx.distributed.Group,
    split: tuple[int, ...] | SplitMode,
    streaming=None,  # a StreamingConfig, or None to keep every expert resident
) -> RankModel:
    """Load lazily, keep this rank's layers, stream their experts, then materialize the rest."""
    model, tokenizer, raw = load(str(path), lazy=True, return_config=True)
    config = ModelConfig.from_dict(raw)
    inner = refuse_unsupported(model, config)
    num_layers = len(inner.layers)
    layer_trimmable = trimmable_layers(make_prompt_cache(model))  # before the cut: every layer
    per_rank = resolve_split(split, group.size(), path, config, num_layers)
    inner.pipeline(group, list(per_rank))
    layers = RankLayers(group.rank(), group.size(), *pipeline_layers(inner), num_layers, per_rank)
    # Lazily loaded arrays know their size: this rank's weights without reading a byte.
    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    resident -= _switch_param_bytes(model)
    streamer = None
    if streaming is not None:
        share = (layers.end - layers.start) / num_layers  # the KV cache is per layer too
        prefix = streaming.prefix_cache_bytes  # None: the plan's automatic share
        cfg = dataclasses.replace(
            streaming,
            kv_bytes=int(streaming.kv_bytes * share),
            prefix_cache_bytes=None if prefix is None else int(prefix * share),
        )
        streamer = install_streaming(model, path, cfg, resident_weight_bytes=resident)
        if not streamer.plan.fits:
            streamer.close()
            raise MemoryPlanRefused(f"rank {layers.rank}: {streamer.plan.refusal()}")
    mx.eval(model.parameters())
    log.info(
        "rank %d/%d: layers %d-%d of %d, %d bytes of resident weights%s",
        layers.rank,
        layers.size,
        layers.start,
        layers.end - 1,
        num_layers,
        resident,
        f", {streamer.resident_bytes} bytes of expert slots" if streamer else "",
    )
    return RankModel(
        model, tokenizer, config, Path(path), streamer, layers, inner, resident, layer_trimmable
    )
