"""Idle-disk lookahead (experts/lookahead.py): tokens identical to resident, the cache's hits,
misses and evictions identical to a run without it, demand reads first."""

from __future__ import annotations

import threading
import time

import pytest
from mlx_lm.utils import load_model

from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.store import ExpertStore
from tests.fixtures.reference import SAMPLER, decode, streaming

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(40)]
MAX_TOKENS = 12
SAME_CACHE = ("hits", "misses", "evictions", "passes", "lane_loads")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_lookahead_is_exact_and_changes_no_admission(checkpoint_factory, arch):
    path = checkpoint_factory(arch, num_layers=4, num_experts=32)
    resident, _ = load_model(path)
    want_greedy = decode(resident, PROMPT, MAX_TOKENS)
    want_sampled = decode(resident, PROMPT, MAX_TOKENS, SAMPLER)
    del resident
    served = 0
    for budget in ("10%", "25%"):
        snaps = {}
        for look in (False, True):
            model, streamer = streaming(path, budget, lookahead=look)
            try:
                assert (streamer.loads.lookahead is not None) is look
                assert decode(model, PROMPT, MAX_TOKENS) == want_greedy, (budget, look)
                assert decode(model, PROMPT, MAX_TOKENS, SAMPLER) == want_sampled, (budget, look)
                snaps[look] = streamer.snapshot()
            finally:
                streamer.close()
        off, on = snaps[False], snaps[True]
        # A guess never takes a slot: the pools admit and evict exactly as without lookahead.
        assert {k: on[k] for k in SAME_CACHE} == {k: off[k] for k in SAME_CACHE}, budget
        # What the lane served was not read again: demand bytes fall by exactly that much.
        assert on["bytes_read"] + on["lookahead_served_bytes"] == off["bytes_read"]
        assert on["lookahead_served"] <= on["lookahead_guessed"]
        assert on["lookahead_served_bytes"] == on["lookahead_served"] * on["expert_bytes"]
        recall = on["lookahead_recall"]
        assert recall[0] == [0, 0]  # nothing predicts the first layer
        assert all(0 <= found <= wanted for found, wanted in recall)
        assert all(wanted > 0 for _found, wanted in recall[1:])
        served += on["lookahead_served"]
    assert served > 0


class GatedStore(ExpertStore):
    """A real store whose demand job waits for a gate, recording the order jobs ran in."""

    def __init__(self, *args, gate: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.ran = gate, []

    def run(self, job):
        self.ran.append(job.offset)
        if job.offset == self.held:
            self.gate.wait(timeout=60)
        return super().run(job)


def test_idle_only_reads_wait_for_every_demand_read(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", bits=4)
    model, streamer = streaming(path, "100%")
    gate = threading.Event()
    store = GatedStore(streamer.index.files, bypass_page_cache=False, gate=gate)
    reader = ReadPool(store, workers=4)
    try:
        pool = streamer.pools[0]
        _hits, loads = pool.admit([0, 1])
        demand = store.jobs_for(pool, pool.stage(loads[:1]))
        idle = store.jobs_for(pool, pool.stage(loads[1:]))
        store.held = demand[0].offset
        demand_batch = reader.submit(demand)
        idle_batch = reader.submit(idle, idle_only=True)
        deadline = time.monotonic() + 60
        while demand_batch.started == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # free workers had the time to take the idle job: none may have
        assert idle_batch.started == 0  # a demand read runs: the disk is not idle
        gate.set()
        reader.wait([demand_batch, idle_batch])
        assert reader.finished(idle_batch) and reader.finished(demand_batch)
        assert store.ran.index(idle[0].offset) > store.ran.index(demand[0].offset)
    finally:
        gate.set()
        reader.close()
        store.close()
        streamer.close()
