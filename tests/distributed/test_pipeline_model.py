"""Two pipeline ranks over the ring backend on loopback give the resident model's tokens.

No daemon here: the rank model, the step protocol and mlx-lm's PipelineMixin alone, with each
rank streaming only its own layers' experts within its own budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from moed.daemon.distributed.guard import write_ring_hostfile
from moed.daemon.distributed.launch import free_port_run
from moed.daemon.experts import CheckpointIndex, StreamingConfig, install_streaming, parse_budget
from tests.fixtures import pipeline_worker

pytestmark = pytest.mark.process

WORKER = Path(pipeline_worker.__file__)
# qwen3_5_moe mixes linear-attention layers (ArraysCache rows) with full attention (KV rows).
ARCHS = ["qwen3_moe", "deepseek_v3", "qwen3_5_moe"]


def run_group(path: Path, budget: str) -> dict:
    port = free_port_run(2)
    with tempfile.TemporaryDirectory() as files:
        # The ring's own hostfile, as rank 0's guard hands it to the ranks that pass it.
        ring = write_ring_hostfile([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]], files)
        procs = []
        for rank in (1, 0):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": ring}
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(path), budget],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0]
    return json.loads(outs[1])


@pytest.fixture(scope="module")
def resident_tokens(checkpoint_factory):
    cache = {}

    def tokens(arch: str):
        if arch not in cache:
            model, _ = load(str(checkpoint_factory(arch, num_layers=4)))
            cache[arch] = {
                "greedy": [
                    pipeline_worker.generate(model, p, pipeline_worker.SamplingParams())
                    for p in pipeline_worker.PROMPTS
                ],
                "seeded": [
                    pipeline_worker.generate(model, p, pipeline_worker.SEEDED)
                    for p in pipeline_worker.PROMPTS
                ],
                "batched": pipeline_worker.batched(model),
            }
            del model
            mx.clear_cache()
        return cache[arch]

    return tokens


@pytest.mark.parametrize("budget", ["25%", "100%"])
@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_match_the_resident_model(checkpoint_factory, resident_tokens, arch, budget):
    path = checkpoint_factory(arch, num_layers=4)
    got = run_group(path, budget)
    want = resident_tokens(arch)
    assert got["greedy"] == want["greedy"]
    assert got["seeded"] == want["seeded"]
    # A continuous batch (rows joining, leaving, finishing apart) is the single-process batch.
    assert got["batched"] == want["batched"]
    assert len(got["batched"]["removed"]) < 30 and len(got["batched"]["joined"]) == 8

    ranks = got["status"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["layers"] for r in ranks] == [[2, 4], [0, 2]]  # rank 0 runs the last layers
    for r in ranks:
        experts = r["experts"]
        # Each rank's budget is a share of its own layers' experts, and it stays within it.
        assert experts["resident_bytes"] <= parse_budget(budget, experts["experts_bytes"])
        assert experts["resident_bytes"] > 0 and experts["misses"] > 0
    # Half the layers each: neither rank holds the other's expert bytes.
    total = sum(r["experts"]["experts_bytes"] for r in ranks)
    assert all(r["experts"]["experts_bytes"] < total for r in ranks)
    link = ranks[0]["link"]
    assert link["forward_tokens"] > 0 and link["bytes_per_token"] > 0

    # Memory: the ranks partition one process's weights and expert slots, except the embeddings,
    # final norm and head that every rank keeps.
    single = one_process_memory(path, budget)
    shared = sum(
        loc.nbytes for name, loc in CheckpointIndex(path).tensors.items() if "layers." not in name
    )
    weights = [r["resident_weight_bytes"] for r in ranks]
    assert sum(weights) - shared == single["weights"]
    assert sum(r["experts"]["resident_bytes"] for r in ranks) == single["experts"]
    # About half of the per-layer memory each (deepseek's dense first layer tilts an even split
    # by layer count a little; `--pipeline-split cost` evens it).
    per_layer = single["weights"] + single["experts"] - shared
    for r in ranks:
        mine = r["resident_weight_bytes"] + r["experts"]["resident_bytes"] - shared
        assert 0.4 * per_layer <= mine <= 0.6 * per_layer


def one_process_memory(path: Path, budget: str) -> dict:
    from mlx_lm.utils import load_model

    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model, path, StreamingConfig(cache_budget=budget, memory_bytes=8 << 30)
    )
    try:
        return {"weights": streamer.resident_weight_bytes, "experts": streamer.resident_bytes}
    finally:
        streamer.close()
