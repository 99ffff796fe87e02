"""One rank of a 2-rank pipeline test without the daemon: rank 0 generates, rank 1 follows.

Run as `python pipeline_worker.py MODEL BUDGET` with MLX_RANK / MLX_HOSTFILE set; rank 0 prints
one JSON line: the greedy and seeded tokens for each prompt, the rows of a continuous batch, and
every rank's status.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from moed.daemon.distributed.follower import follow
from moed.daemon.distributed.leader import PipelineLeader
from moed.daemon.distributed.protocol import StepChannel
from moed.daemon.distributed.rank_model import load_rank_model
from moed.daemon.distributed.split import SplitMode
from moed.daemon.engine.batch import DecodeBatch
from moed.daemon.engine.sampling import SamplingParams, make_position_sampler
from moed.daemon.experts import StreamingConfig

# A short prompt (tokens travel inside the step header) and a long one (a separate payload).
PROMPTS = [[1, 5, 9, 22, 7, 3], [(7 * i + 3) % 300 + 3 for i in range(300)]]
MAX_TOKENS = 8
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)


def generate(model, prompt: list[int], params: SamplingParams) -> list[int]:
    sampler = make_position_sampler(params, len(prompt), default_seed=0)
    steps = generate_step(
        mx.array(prompt, dtype=mx.uint32),
        model,
        max_tokens=MAX_TOKENS,
        sampler=sampler,
        prefill_step_size=128,
    )
    return [int(t) for t, _ in steps]


def batched(model) -> dict[str, list[int]]:
    """A continuous batch through `model`: rows of different lengths prefill together, one joins
    mid-batch (its prompt read in chunks between decode steps), one is removed, the others finish
    at different steps."""
    # Chunks of 2 (the smallest): beside decoding rows a chunk is sized from measured step
    # times, so any larger limit would let two runs read a prompt in different pieces.
    batch = DecodeBatch(model, eos_token_ids=[], max_batch=4, prefill_chunk=2)
    names: dict[int, str] = {}
    out: dict[str, list[int]] = {}

    def add(name: str, prompt: list[int], max_tokens: int, params: SamplingParams) -> None:
        sampler = make_position_sampler(params, len(prompt), default_seed=0)
        names[batch.insert(prompt, max_tokens, sampler)] = name
        out[name] = []

    add("short", PROMPTS[0], 10, SamplingParams())
    add("long", PROMPTS[1][:150], 6, SEEDED)
    add("removed", PROMPTS[1][40:47], 30, SamplingParams())
    steps = 0
    while batch.rows:
        for tok in batch.step().tokens:
            out[names[tok.uid]].append(tok.token)
        steps += 1
        if steps == 2:
            add("joined", PROMPTS[1][:200], 8, SEEDED)
        if steps == 6:
            batch.remove(next(u for u, n in names.items() if n == "removed"))
    batch.close()
    return out


def main() -> None:
    path, budget = Path(sys.argv[1]), sys.argv[2]
    group = mx.distributed.init(backend="ring", strict=True)
    streaming = StreamingConfig(cache_budget=budget, memory_bytes=8 << 30)
    rank = load_rank_model(path, group, SplitMode.EVEN, streaming)
    channel = StepChannel(group)
    if group.rank() != 0:
        follow(rank, channel)
        return
    leader = PipelineLeader(rank, channel)
    out = {
        "greedy": [generate(leader, p, SamplingParams()) for p in PROMPTS],
        "seeded": [generate(leader, p, SEEDED) for p in PROMPTS],
        "batched": batched(leader),
    }
    out["status"] = leader.status()
    leader.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
