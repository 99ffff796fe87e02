"""How many prompt tokens one chunk may read when no row decodes: as many as the memory plan's
working memory and the KV room the running batch leaves unused can hold.

Under streaming every chunk reads nearly every expert of every layer (a 256-token chunk routes
to most of them), so the bytes read per prompt token fall as the chunk grows; the bound is the
memory a chunk's activations take, estimated per token from the model's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moed.protocol.model_config import ModelConfig

# A prompt chunk's hidden-state copies alive at once in one layer (residual, norm, attention
# and MLP outputs, the sorted rows of the expert kernels).
_HIDDEN_COPIES = 8
# The expert kernels' intermediates per routed row: gate, up and their activated product.
_EXPERT_COPIES = 3
_SCORE_BYTES = 4  # attention scores are float32 where the fused kernel does not run


@dataclass(frozen=True)
class ChunkBudget:
    working_bytes: int  # the plan's working memory (activations, MLX's buffers)
    kv_bytes_per_token: int  # one context token's KV rows, every layer
    plan_kv_tokens: int  # the KV rows the plan keeps room for (plan_context_tokens)
    state_bytes: int  # a chunk token's activations but its attention scores
    score_bytes: int  # ... and its attention scores, per token of context
    floor: int  # prefill_chunk: a lone prompt never reads smaller chunks than configured

    def token_bytes(self, context_tokens: int) -> int:
        return self.state_bytes + self.score_bytes * max(1, context_tokens)

    def alone(self, kv_tokens_in_use: int, context_tokens: int | None = None) -> int:
        """The chunk for prompts read with no decoding row beside them: the batch holds
        `kv_tokens_in_use` KV rows, its longest row reaches `context_tokens` (default: the
        plan's whole context)."""
        spare_kv = max(0, self.plan_kv_tokens - kv_tokens_in_use) * self.kv_bytes_per_token
        context = self.plan_kv_tokens if context_tokens is None else context_tokens
        tokens = (self.working_bytes + spare_kv) // self.token_bytes(context)
        return max(self.floor, min(int(tokens), self.plan_kv_tokens))


def chunk_budget(
    config: ModelConfig, working_bytes: int, plan_kv_tokens: int, floor: int, dtype_bytes: int = 2
) -> ChunkBudget:
    return ChunkBudget(
        working_bytes=working_bytes,
        kv_bytes_per_token=kv_bytes_per_token(config, dtype_bytes),
        plan_kv_tokens=plan_kv_tokens,
        state_bytes=activation_bytes_per_token(config, 0, dtype_bytes),
        score_bytes=config.int_of("num_attention_heads", 1) * _SCORE_BYTES,
        floor=floor,
    )


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    cfg = config.text
    heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads") or 1)
    return 2 * int(cfg.get("num_hidden_layers") or 1) * heads * _head_dim(cfg) * dtype_bytes


def activation_bytes_per_token(
    config: ModelConfig, context_tokens: int, dtype_bytes: int = 2
) -> int:
    """One chunk token's working memory in its heaviest layer: hidden states, the routed rows
    of the expert kernels, and a row of attention scores over the whole context."""
    cfg = config.text
    hidden = config.hidden_size or 1
    top_k = config.experts_per_token or 1
    width = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or hidden)
    heads = int(cfg.get("num_attention_heads") or 1)
    states = _HIDDEN_COPIES * hidden * dtype_bytes
    experts = top_k * (_EXPERT_COPIES * width + 2 * hidden) * dtype_bytes
    scores = heads * context_tokens * _SCORE_BYTES
    return states + experts + scores


def _head_dim(cfg: Mapping[str, Any]) -> int:
    heads = int(cfg.get("num_attention_heads") or 1)
    return int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or heads) // heads))
