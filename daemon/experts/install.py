"""Put expert streaming into a lazily loaded mlx-lm model."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.nn as nn

from moed.daemon.experts.discover import describe_switches, set_module
from moed.daemon.experts.row_split import split_rows_exact
from moed.daemon.experts.safetensors_index import CheckpointIndex
from moed.daemon.experts.streamer import ExpertStreamer
from moed.daemon.experts.streaming_config import StreamingConfig
from moed.daemon.experts.streaming_switch import StreamingSwitch

log = logging.getLogger(__name__)


def install_streaming(
    model: nn.Module,
    model_path: Path,
    cfg: StreamingConfig | None = None,
    resident_weight_bytes: int | None = None,
) -> ExpertStreamer:
    """Replace every SwitchGLU / SwitchMLP of a lazily loaded mlx-lm model with a streaming twin.
    Call before `mx.eval(model.parameters())`, which then materializes only non-expert weights."""
    cfg = cfg or StreamingConfig()
    index = CheckpointIndex(Path(model_path))
    switches = describe_switches(model, index)
    streamer = ExpertStreamer(Path(model_path), cfg, index, switches, resident_weight_bytes)
    last = _last_layer_modules(model)
    first: StreamingSwitch | None = None
    for layer, sw in enumerate(switches):
        final = any(sw.module is m for m in last)
        twin = StreamingSwitch(
            sw.kind, sw.projs, sw.module.activation, layer, streamer, final, sw.num_experts
        )
        set_module(model, sw.path, twin)
        first = first or twin
    if first is not None and not split_rows_exact(first, streamer.pools[0].arrays):
        streamer.keep_rows_together()
    log.info(
        "streaming %d MoE layers, %d slots per layer\n%s",
        len(switches),
        min(streamer.slots),
        streamer.plan.describe(),
    )
    return streamer


def _last_layer_modules(model: nn.Module) -> list[nn.Module]:
    """The modules inside the model's last decoder layer (mlx-lm models list theirs as
    `layers`); none where there is no such list."""
    layers = getattr(model, "layers", None) or []
    last = layers[-1] if layers else None
    if not isinstance(last, nn.Module):
        return []
    return [m for _, m in last.named_modules()]
