"""The prefix cache under `moed serve --pipeline 2`: rank 0 decides, and every rank keeps its own
layers of each entry (distributed/cache_ops.py's EXTRACT / OWN / RESUME ops). A conversation's
later turns resume from the cache (cached_tokens > 0) with the tokens plain mlx-lm generates,
attention-only and hybrid (qwen3_next: the follower's layers are linear attention, resumed from
recurrent-state checkpoints), greedy and seeded; both ranks hold the same entries, and clearing
the cache frees them on both."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load

from moed.client import Client, DoneEvent, TokenEvent
from tests.fixtures import pipeline_worker
from tests.fixtures.engine_driver import SYSTEM, TURNS
from tests.fixtures.pipeline_requests import rank_lists

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def converse(client: Client, **sampling) -> list[tuple[list[int], int]]:
    out = []
    for ids in TURNS:
        got, cached = [], None
        for event in client.generate(
            prompt_ids=ids, max_tokens=pipeline_worker.MAX_TOKENS, **sampling
        ):
            if isinstance(event, TokenEvent):
                got += event.ids
            elif isinstance(event, DoneEvent):
                cached = event.usage["cached_tokens"]
        out.append((got, cached))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_every_rank_caches_its_layers_and_hits_give_mlx_lm_tokens(
    supervisor, checkpoint_factory, arch
):
    path = checkpoint_factory(arch, num_layers=4)
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    model, _ = load(str(path))
    greedy_expected = [
        pipeline_worker.generate(model, ids, pipeline_worker.SamplingParams()) for ids in TURNS
    ]
    seeded_expected = [
        pipeline_worker.generate(model, ids, pipeline_worker.SamplingParams(**seeded))
        for ids in TURNS
    ]
    del model

    sup = supervisor(
        path, "--pipeline", "2", "--cache-budget", "25%", "--prefill-chunk", "8",
        "--prefix-checkpoint-tokens", "8", "--prefix-cache", "64MB",
    )  # fmt: skip
    sup.wait_ready()
    with Client(sup.socket) as c:
        greedy = converse(c)
        c.prefix_cache("clear")
        sampled = converse(c, **seeded)
        listing = c.prefix_cache("list")

        assert [t for t, _ in greedy] == greedy_expected
        assert [t for t, _ in sampled] == seeded_expected
        for got in (greedy, sampled):
            cached = [n for _, n in got]
            assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached
            if arch == "qwen3_moe":  # attention layers on both ranks: the exact common prefix
                assert cached[1] == 30 and cached[2] == len(SYSTEM)
            else:  # the follower's recurrent state: the nearest checkpoint (every 8 tokens)
                assert cached[1] == 24 and cached[2] == len(SYSTEM) - 1
        snap = c.status()["prefix_cache"]
        assert snap["hits"] >= len(TURNS) - 1 and listing["entries"], (snap, listing)
        assert snap.get("disk_entries") is None  # memory only under a pipeline
        # Rank 0's live cache lists are the follower's twins, one for one.
        lists = rank_lists(c, lambda n: n[0] == n[1])
        assert lists[0] == lists[1] > 0, lists

        c.prefix_cache("clear")
        after = rank_lists(c, lambda n: n == [0, 0])
        assert after == [0, 0], after
        # A cleared cache reads the whole prompt again, with the same tokens.
        first, cached = converse(c)[0]
        assert first == greedy_expected[0] and cached == 0
