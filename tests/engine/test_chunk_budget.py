"""A prompt read alone takes chunks as large as the memory plan allows: its working memory plus
the KV room the batch leaves unused, over a chunk token's activations (Qwen3.6-35B-A3B's shapes),
never below `prefill_chunk` nor above the plan's context; rows read together share it."""

from __future__ import annotations

import json

from moed.daemon.engine.batch import ChunkSizer
from moed.daemon.engine.chunk_budget import (
    activation_bytes_per_token,
    chunk_budget,
    kv_bytes_per_token,
)
from moed.protocol.model_config import ModelConfig

# Qwen3.6-35B-A3B's text config (the shapes that matter here).
QWEN36 = ModelConfig.from_dict(
    {
        "text_config": {
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
        }
    }
)
MiB = 2**20


def test_a_lone_chunk_grows_with_working_memory_and_spare_kv():
    budget = chunk_budget(QWEN36, 256 * MiB, plan_kv_tokens=32768, floor=256)
    # A chunk token's activations grow with the context its attention reads.
    assert budget.token_bytes(32768) == activation_bytes_per_token(QWEN36, 32768)
    assert budget.token_bytes(32768) > budget.token_bytes(4096)
    per_token = budget.token_bytes(4096)
    full = budget.alone(kv_tokens_in_use=32768, context_tokens=4096)  # no KV room left
    assert full == 256 * MiB // per_token > 256
    roomy = budget.alone(kv_tokens_in_use=4096, context_tokens=4096)  # unused KV room counts
    spare = (32768 - 4096) * kv_bytes_per_token(QWEN36)
    assert roomy == (256 * MiB + spare) // per_token > full


def test_a_lone_chunk_stays_within_the_floor_and_the_plan():
    tight = chunk_budget(QWEN36, 1 * MiB, plan_kv_tokens=32768, floor=256)
    assert tight.alone(32768) == 256  # never below prefill_chunk
    small_plan = chunk_budget(QWEN36, 64 * 1024 * MiB, plan_kv_tokens=1024, floor=256)
    assert small_plan.alone(0) == 1024  # never past the context the plan keeps room for


def test_the_sizer_uses_the_budget_only_when_no_row_decodes():
    budget = chunk_budget(QWEN36, 256 * MiB, plan_kv_tokens=32768, floor=256)
    sizer = ChunkSizer(256, budget)
    lone = budget.alone(4096, 4096)
    assert lone > 256
    assert sizer.chunk(decoding=False, prompting=1, longest=4096) == lone
    # Two rows read together: padded to the longest, the room is shared.
    assert sizer.chunk(decoding=False, prompting=2, longest=4096) == max(
        256, budget.alone(8192, 4096) // 2
    )
    assert sizer.chunk(decoding=True) == sizer.size <= 256  # beside decoding rows: steered
    assert ChunkSizer(256).chunk(decoding=False) == 256  # no plan (a pipeline): prefill_chunk


def test_a_lone_prompt_chunk_is_sized_by_the_prompt_not_its_max_tokens(tiny_model):
    """An open-ended request (max_tokens: the rest of a long context) reads its prompt in the
    chunks a short max_tokens gets: while no row decodes, only the prompt's KV exists and only
    the prompt is attended; the room its answer may grow into is not taken yet."""
    from mlx_lm.utils import load_model

    from moed.daemon.engine.batch import DecodeBatch
    from moed.daemon.engine.sampling import greedy

    model, _ = load_model(tiny_model)
    config = ModelConfig.from_dict(json.loads((tiny_model / "config.json").read_text()))
    budget = chunk_budget(config, 4 * MiB, plan_kv_tokens=4096, floor=8)
    prompt = list(range(5, 5 + 300))
    chunks = []
    for max_tokens in (4, 3796):  # a default-sized answer; the rest of a 4096-token context
        batch = DecodeBatch(model, [], max_batch=1, prefill_chunk=8, budget=budget)
        batch.insert(prompt, max_tokens, greedy)
        batch.step()
        chunks.append(batch.largest_chunk)
        batch.close()
    assert chunks[0] == chunks[1] == budget.alone(len(prompt), len(prompt)) > 8
