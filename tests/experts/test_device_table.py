"""The expert -> slot table a decode call's graph reads on the device (cache.py `device_table`):
it agrees with the host's table for every resident expert through admissions, evictions, a
resize and a hold; for a DIRECT pool a lookup built before an admission and evaluated after it
reads the slots the admission gave (the decode graph is built before the router's read-back,
host_route.py), for both landings a lookup built after it does."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest

from moed.daemon.experts.cache import LayerPool, PooledTensor
from moed.daemon.experts.landing import Landing
from moed.daemon.experts.policies import make_policy
from moed.daemon.experts.safetensors_index import TensorLoc

EXPERTS, SLOTS = 32, 8


def pool_of(landing: Landing) -> LayerPool:
    loc = TensorLoc("w", Path("unused"), "F32", (EXPERTS, 2, 4), 0, EXPERTS * 2 * 4 * 4)
    tensors = [PooledTensor("gate_proj", "weight", loc)]
    return LayerPool(0, tensors, EXPERTS, SLOTS, make_policy("lfu", EXPERTS, SLOTS), landing)


def agrees(pool: LayerPool) -> bool:
    table = pool.device_table().tolist()
    return all(table[e] == pool.slot_of[e] for e in pool.resident)


@pytest.mark.parametrize("landing", [Landing.DIRECT, Landing.STAGED])
def test_the_device_table_follows_the_slot_table(landing):
    rng = random.Random(7)
    pool = pool_of(landing)
    for _ in range(300):
        ids = rng.sample(range(EXPERTS), rng.choice([1, 2, 4, SLOTS]))
        before = mx.take(pool.device_table(), mx.array(ids, dtype=mx.uint32))  # not evaluated
        pool.begin_call()
        pool.admit(ids)
        want = [pool.slot_list[e] for e in ids]
        assert mx.take(pool.device_table(), mx.array(ids, dtype=mx.uint32)).tolist() == want
        if landing is Landing.DIRECT:  # written in place: the earlier lookup sees the admission
            assert before.tolist() == want
        assert agrees(pool)
    pool.resize(SLOTS // 2)
    assert agrees(pool)
    pool.resize(EXPERTS)
    pool.begin_call()
    pool.admit([e for e in range(EXPERTS) if pool.slot_list[e] < 0])
    pool.hold()
    assert pool.device_table().tolist() == list(range(EXPERTS))
