"""The daemon's side of a pipeline: refuse what cannot pipeline, start the group, load rank 0.

Rank 0 is the `moed serve` process: it owns the socket and the scheduler, runs the model's last
layers, samples, and drives the other ranks through `PipelineLeader`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx_lm

from moed.daemon.config import ServeConfig
from moed.daemon.distributed.guard import Rendezvous, new_secret
from moed.daemon.distributed.hostfile import Backend
from moed.daemon.distributed.launch import RankGroup
from moed.daemon.distributed.leader import PipelineLeader
from moed.daemon.distributed.protocol import StepChannel
from moed.daemon.distributed.rank_model import PipelineUnsupported, load_rank_model, num_layers
from moed.daemon.distributed.ring_handoff import init_ring
from moed.daemon.distributed.ring_links import LinkListeners, form_links
from moed.daemon.distributed.spec import RankSpec, group_spec, rank_spec
from moed.daemon.model.loader import LoadedModel
from moed.daemon.model.mlx_compat import pipelined_architectures, supports_pipeline
from moed.protocol.model_config import ModelConfig

log = logging.getLogger("moed.distributed")


@dataclass(frozen=True)
class StartedGroup:
    """What start_group decided, for load_leader in the same process (never through the
    environment, which every child would inherit)."""

    spec: RankSpec
    ranks: RankGroup
    guard: Rendezvous
    listeners: LinkListeners  # rank 0's ring ports, named by the guard


_started: StartedGroup | None = None


def check_supported(model_path: Path) -> None:
    """Refuse an architecture without mlx-lm pipeline support before any rank starts."""
    config = ModelConfig.read(model_path)
    if supports_pipeline(config.raw):
        return
    raise PipelineUnsupported(
        f"model type {config.model_type!r} has no pipeline support in mlx-lm "
        f"{mlx_lm.__version__} (no PipelineMixin); serve it without --pipeline/--hostfile, or use "
        f"one of: {', '.join(pipelined_architectures())}"
    )


def start_group(serve: ServeConfig, model_path: Path) -> RankGroup:
    """Start ranks 1..N-1 and set rank 0's own environment for mx.distributed.init."""
    check_supported(model_path)
    group = group_spec(serve)
    spec = rank_spec(serve, group, model_path, ModelConfig.read(model_path))
    ranks = RankGroup(group, serve.rank_timeout_s)
    secret = new_secret()
    # Listening before any follower starts: the published port is the guard, not the ring; the
    # ring's ports are moed's too (ring_links.py), open before the guard names them.
    listeners = LinkListeners(group.hosts[0].ips)
    guard = Rendezvous(group.hosts, group.guard_address, secret, listeners.addresses)
    global _started
    _started = StartedGroup(spec, ranks, guard, listeners)
    ranks.start(spec.to_json(), secret)
    log.info(
        "pipeline of %d ranks over %s (split %s, budgets %s)",
        group.size,
        group.backend.value,
        spec.split,
        spec.budgets,
    )
    return ranks


def load_leader(serve: ServeConfig, path: Path) -> LoadedModel:
    """Join the group as rank 0 and load its layers; returns the engine's LoadedModel."""
    if _started is None:
        raise RuntimeError("load_leader before start_group")
    spec, ranks, guard = _started.spec, _started.ranks, _started.guard
    listeners = _started.listeners

    def failed() -> str | None:
        return ranks.failure.reason if ranks.failure else None

    try:
        ring = guard.wait(failed)
        if spec.backend == Backend.RING.value:
            # Over links proved with the group's secret, never ports a stranger reached first.
            links = form_links(0, ring, listeners, guard.secret, failed=failed)
            group = init_ring(links, 0, len(ring), ranks.files)
        else:
            group = mx.distributed.init(backend=spec.backend, strict=True)
    finally:
        listeners.close()
    ranks.group_formed()  # every follower is past its init: silence counts from here
    split = spec.split_for(group.size(), num_layers(path))
    streaming = spec.streaming(0)
    if streaming is not None:
        from dataclasses import replace

        streaming = replace(
            streaming,
            state_dir=serve.state_dir,
            prefetch_next=serve.prefetch_next,
            lookahead=serve.lookahead,
        )
    rank = load_rank_model(path, group, split, streaming)
    leader = PipelineLeader(rank, StepChannel(group))
    # The engine drives the leader as its model: every forward is broadcast to the group first.
    return LoadedModel(leader, rank.tokenizer, path, rank.config, rank.streamer, leader)
