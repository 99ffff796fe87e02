"""Rank 0's side of the pipeline: the model mlx-lm and the engine see.

`PipelineLeader` stands in for the mlx-lm model on rank 0. Each forward first broadcasts the step
(the tokens and the cache list they run on) so that every other rank runs the same forward through
its own layers; mlx-lm's PipelineMixin then carries the activations (send/recv, a final
all_gather). Cache lists end with a `CacheHandle` (cache_ops.py): whatever mlx-lm's
BatchGenerator does to a batch's caches (merge, extend, pad, copy, filter, drop) reaches the
followers with the next step, so one batched decode step is one forward through the ranks.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from moed.daemon.distributed.cache_ops import CacheHandle, CacheOp, OpLog
from moed.daemon.distributed.protocol import Step, StepChannel, StepOp
from moed.daemon.distributed.rank_model import RankModel
from moed.daemon.distributed.rank_status import rank_status
from moed.daemon.model.layer_caches import trimmable_layers
from moed.daemon.model.mlx_compat import wrap_pipeline_norm


class GatherFence(nn.Module):
    """Rank 0's final norm, evaluating its input first. PipelineMixin ends every forward with an
    all_gather that the followers always run; mlx-lm on rank 0 may evaluate only the KV cache of
    a prefill chunk (never the logits), which would leave the followers waiting in that
    all_gather. Evaluating here keeps every rank's collectives in the same order."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def __call__(self, h: mx.array) -> mx.array:
        mx.eval(h)
        return self.norm(h)


class PipelineLeader:
    def __init__(self, rank: RankModel, channel: StepChannel):
        self.rank = rank
        self.model = rank.model
        self.channel = channel
        self._ops = OpLog()
        self._lock = threading.Lock()  # one step at a time (status may come from another thread)
        self._hidden = rank.config.hidden_size or 0
        norm = wrap_pipeline_norm(rank.pipeline, GatherFence)
        self._act_itemsize = norm.weight.dtype.size
        self.activation_bytes = 0  # activations moved between ranks, summed over forwards
        self.forward_tokens = 0

    # -- what mlx-lm calls --------------------------------------------------------------------
    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        if kwargs.get("input_embeddings") is not None:
            raise ValueError("a pipeline runs token inputs only (no input embeddings)")
        if not cache or not isinstance(cache[-1], CacheHandle) or not cache[-1].handle:
            raise ValueError("a pipeline forward needs a cache list made by make_cache()")
        tokens = np.array(inputs, dtype=np.int32)  # waits for the sampled token: steps stay ordered
        tokens = tokens.reshape(1, -1) if tokens.ndim == 1 else tokens
        with self._lock:
            self.channel.send(
                Step(StepOp.FORWARD, 0, (cache[-1].handle,), self._ops.drain(), tokens)
            )
            self._count_activations(tokens.size)
            return self.model(inputs, cache=cache[:-1])

    def make_cache(self) -> list:
        """This rank's layer caches and, last, the handle of the followers' twin list."""
        return [*make_prompt_cache(self.model), self._ops.new_handle()]

    def cache_trimmable(self) -> tuple[bool, ...]:
        """Which elements of a make_cache() list can be cut back: this rank's layers, then the
        handle, which can when every other rank's layer can."""
        own = trimmable_layers(make_prompt_cache(self.model))
        r = self.rank.layers
        others = [t for i, t in enumerate(self.rank.layer_trimmable) if not r.start <= i < r.end]
        return (*own, all(others))

    def __getattr__(self, name: str) -> Any:  # layers, args, parameters(), ... of the real model
        return getattr(self.model, name)

    # -- group-wide operations (engine thread, between steps) -------------------------------
    def status(self) -> list[dict]:
        """Every rank's status, rank 0 first."""
        with self._lock:
            self.channel.send(Step(StepOp.STATUS, 0, ops=self._ops.drain()))
            return self.channel.gather_json(rank_status(self.rank, self.link(), self._ops.live))

    def record(self, op: CacheOp, *args: int) -> None:
        """A cache op of the SSD tier's (rank_disk.py), from any thread: the next step takes it."""
        self._ops.record(op, *args)

    @property
    def ops_pending(self) -> bool:
        return self._ops.pending

    def sync(self) -> None:
        """Carry the cache ops recorded since the last step to the followers now (an idle
        engine's: a follower writes its part of an entry soon after rank 0 wrote its own)."""
        with self._lock:
            if self._ops.pending:
                self.channel.send(Step(StepOp.SYNC, 0, ops=self._ops.drain()))

    def load_prefix(
        self, key: list[int], n_states: int
    ) -> tuple[CacheHandle, list[CacheHandle]] | None:
        """Every follower reads its part of an SSD entry into new cache lists: the layers' handle
        and `n_states` checkpoint handles, or None when any rank could not."""
        with self._lock:
            layers = self._ops.new_handle()
            states = [self._ops.new_handle() for _ in range(n_states)]
            self._ops.record(
                CacheOp.LOAD, layers.handle, *key, n_states, *(s.handle for s in states)
            )
            self.channel.send(Step(StepOp.PREFIX_LOAD, 0, ops=self._ops.drain()))
            answers = self.channel.gather_json({"ok": True})
        if all(a.get("ok") for a in answers):
            return layers, states
        return None  # the handles go: their RELEASE frees what some ranks did read

    def shed(self, fraction: float) -> None:
        """Ask every follower to shrink its expert cache (rank 0 sheds its own)."""
        with self._lock:
            self.channel.send(Step(StepOp.SHED, 0, ops=self._ops.drain(), arg=int(fraction * 1000)))

    def shutdown(self) -> None:
        with self._lock:
            self.channel.send(Step(StepOp.SHUTDOWN, 0))

    def link(self) -> dict:
        c = self.channel.counters
        per_token = (self.activation_bytes + c.broadcast_bytes) / max(1, self.forward_tokens)
        return {
            "steps": c.steps,
            "forward_tokens": self.forward_tokens,
            "activation_bytes": self.activation_bytes,
            "broadcast_bytes": c.broadcast_bytes,
            "bytes_per_token": per_token,
            "steps_by_op": dict(c.by_op),
        }

    def _count_activations(self, n_tokens: int) -> None:
        """PipelineMixin moves each token's hidden state once per hop (send/recv) and then
        all_gathers every rank's copy to every rank."""
        size = self.channel.size
        act = n_tokens * self._hidden * self._act_itemsize
        self.activation_bytes += act * (size - 1) + act * size * (size - 1)
        self.forward_tokens += n_tokens
