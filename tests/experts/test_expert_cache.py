"""Cache budget, shedding, the usage profile and the memory plan."""

from __future__ import annotations

import json
import threading

import pytest
from mlx_lm.utils import load_model

from moed.daemon.experts import (
    BudgetError,
    StreamingConfig,
    parse_budget,
    plan_memory,
)
from moed.daemon.experts.landing import Landing
from moed.daemon.experts.memory_plan import cgroup_memory_limit, machine_memory
from tests.fixtures.checkpoints import ARCHS
from tests.fixtures.reference import MEMORY, decode, resident, streaming

PROMPT = [(11 * i + 5) % 300 + 3 for i in range(60)]


@pytest.mark.parametrize(
    "spec,want",
    [
        (1000, 1000),
        ("1000", 1000),
        ("12GB", 12 * 10**9),
        ("512MB", 512 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("25%", 250),
        ("0.25", 250),
        (0.5, 500),
        ("100%", 1000),
        ("auto", 777),
    ],
)
def test_parse_budget(spec, want):
    assert parse_budget(spec, 1000, auto_bytes=777) == want


@pytest.mark.parametrize("spec", ["", "abc", "-5", "0", "150%", "0%", "12XB", "auto"])
def test_parse_budget_rejects(spec):
    with pytest.raises(BudgetError):
        parse_budget(spec, 1000)


def test_shed_shrinks_cache_and_keeps_tokens(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    resident, _ = load_model(path)
    want = decode(resident, PROMPT, 16)
    model, streamer = streaming(path, "100%")
    try:
        decode(model, PROMPT, 8)  # fill the cache
        before = streamer.snapshot()
        assert before["slots_per_layer"] == [8, 8]
        released = streamer.shed(0.5)
        after = streamer.snapshot()
        assert (
            released
            == before["resident_bytes"] - after["resident_bytes"]
            == before["resident_bytes"] // 2
        )
        assert (
            after["slots_per_layer"] == [4, 4] and after["budget_bytes"] == after["resident_bytes"]
        )
        assert after["cached_experts"] == 8  # the most recent experts survive the shrink
        assert decode(model, PROMPT, 16) == want

        # From another thread: applied by the engine thread at the next token.
        t = threading.Thread(target=lambda: streamer.shed(0.0))
        t.start()
        t.join()
        assert streamer.snapshot()["slots_per_layer"] == [4, 4]
        assert decode(model, PROMPT, 16) == want
        assert streamer.snapshot()["slots_per_layer"] == [1, 1]
    finally:
        streamer.close()


def test_profile_saved_atomically_and_warms_the_next_start(checkpoint_factory, tmp_path):
    path = checkpoint_factory("olmoe")
    want = decode(resident(path), PROMPT, 8)
    model, streamer = streaming(path, "50%", state_dir=tmp_path)
    try:
        assert decode(model, PROMPT, 8) == want
        assert streamer.warm() == 0  # no profile yet
        saved = streamer.save_profile()
        cold = streamer.snapshot()
    finally:
        streamer.close()
    assert saved.parent == tmp_path / "profiles" and saved.exists()
    data = json.loads(saved.read_text())
    assert len(data["layers"]) == 2 and sum(map(sum, data["layers"])) > 0
    assert not [p for p in saved.parent.iterdir() if p.name.startswith(".")]  # no temp files left

    model, streamer = streaming(path, "50%", state_dir=tmp_path)
    try:
        warmed = streamer.warm()
        snap = streamer.snapshot()
        assert warmed == snap["warm_bytes"] == 8 * snap["expert_bytes"]  # 4 slots x 2 layers
        assert snap["misses"] == 0 and snap["bytes_read"] == 0
        assert decode(model, PROMPT, 8) == want
        assert streamer.snapshot()["misses"] < cold["misses"]
        # The most used experts of each layer are the ones warmed.
        top = sorted(range(8), key=lambda e: -data["layers"][0][e])[:4]
        assert set(top) <= set(range(8)) and snap["cached_experts"] == 8
        streamer.save_profile()
        assert sum(map(sum, json.loads(saved.read_text())["layers"])) > sum(
            map(sum, data["layers"])
        )
    finally:
        streamer.close()


def test_corrupt_profile_is_ignored(checkpoint_factory, tmp_path):
    path = checkpoint_factory("qwen3_moe")
    model, streamer = streaming(path, "50%", state_dir=tmp_path)
    try:
        streamer.profile_path.parent.mkdir(parents=True)
        streamer.profile_path.write_text("{not json")
        assert streamer.warm() == 0
        streamer.profile_path.write_text(json.dumps({"version": 1, "layers": [[1, 2]]}))
        assert streamer.warm() == 0
    finally:
        streamer.close()


def test_memory_plan(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    mem = (10**9, 10**9, "test")
    plan = plan_memory(
        path,
        StreamingConfig(cache_budget="50%"),
        kv_bytes=1000,
        working_bytes=2000,
        baseline_bytes=4000,
        memory=mem,
    )
    assert (
        plan.fits and plan.slots_per_layer == 4 and plan.num_experts == 8 and plan.num_layers == 2
    )
    assert plan.cache_budget_bytes * 2 == plan.experts_bytes
    # the pass lane: one more pool of a layer's 4 slots (pass_lane.py)
    assert plan.lane_bytes * plan.num_layers == plan.cache_budget_bytes
    assert (
        plan.required_bytes
        == plan.resident_bytes + plan.cache_budget_bytes + plan.lane_bytes + 7000
    )
    text = plan.describe()
    for word in (
        "resident weights",
        "expert cache",
        "pass lane",
        "KV cache",
        "working memory",
        "process baseline",
        "fits",
        "4 of 8 slots",
    ):
        assert word in text

    tight = plan_memory(
        path,
        StreamingConfig(cache_budget="100%"),
        working_bytes=1,
        baseline_bytes=0,
        memory=(10**5, 10**5, "test"),
    )
    assert not tight.fits and "does not fit" in tight.refusal()

    # auto: what is left after resident weights, KV and working memory, and the pass lane's
    # room where not every expert fits; clamped to [1 slot, all].
    roomy = plan_memory(path, StreamingConfig(), working_bytes=1, baseline_bytes=0, memory=mem)
    assert roomy.slots_per_layer == 8 and roomy.lane_bytes == 0
    per_slot = plan.cache_budget_bytes // 4  # one slot in each of the 2 layers
    room = plan.resident_bytes + 1 + 3 * per_slot + 3 * per_slot // 2 + per_slot // 4
    auto = plan_memory(
        path, StreamingConfig(), working_bytes=1, baseline_bytes=0, memory=(room, room, "test")
    )
    assert auto.slots_per_layer == 3 and auto.fits and auto.lane_bytes == 3 * per_slot // 2
    no_lane = plan_memory(
        path,
        StreamingConfig(landing=Landing.STAGED),
        working_bytes=1,
        baseline_bytes=0,
        memory=(room, room, "test"),
    )
    assert no_lane.lane_bytes == 0 and no_lane.slots_per_layer == 4  # a staged pool has no lane
    none = plan_memory(
        path, StreamingConfig(), working_bytes=1, baseline_bytes=0, memory=(1000, 1000, "test")
    )
    assert none.slots_per_layer == 1 and not none.fits


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_from_names_matches_the_model(checkpoint_factory, arch):
    """The pre-load plan (tensor names only) sees the same experts as the loaded model."""
    path = checkpoint_factory(arch, bits=4 if arch in ("gpt_oss", "qwen3_moe") else None)
    model, streamer = streaming(path, "50%")
    try:
        plan = plan_memory(
            path, StreamingConfig(cache_budget="50%"), memory=(MEMORY, MEMORY, "test")
        )
        assert plan.experts_bytes == streamer.layout.experts_bytes
        assert plan.resident_bytes == streamer.resident_weight_bytes
        assert plan.cache_budget_bytes == streamer.resident_bytes
        assert streamer.memory_plan().cache_budget_bytes == streamer.resident_bytes
        assert streamer.lane is not None and plan.lane_bytes == streamer.lane.nbytes
    finally:
        streamer.close()


def test_machine_memory():
    total, usable, source = machine_memory()
    assert 0 < usable <= total and source
    limit = cgroup_memory_limit()
    assert limit is None or limit >= total


def test_snapshot_is_plain_data(checkpoint_factory):
    import msgpack

    path = checkpoint_factory("qwen3_moe")
    model, streamer = streaming(path, "25%")
    try:
        decode(model, PROMPT, 8)
        snap = streamer.snapshot()
        assert msgpack.unpackb(msgpack.packb(snap)) == snap
        for key in (
            "hits",
            "misses",
            "bytes_read",
            "read_s",
            "stall_s",
            "router_readback_s",
            "layer_hit_rates",
            "resident_bytes",
            "budget_bytes",
            "slots_per_layer",
            "expert_bytes",
            "tokens",
        ):
            assert key in snap
        assert snap["hits"] + snap["misses"] > 0 and snap["router_readback_s"] > 0
    finally:
        streamer.close()


def test_an_unstreamable_dtype_is_a_checkpoint_error():
    import pytest

    from moed.daemon.experts import CheckpointError
    from moed.daemon.experts.cache import mlx_dtype

    assert mlx_dtype("F32") is not None
    with pytest.raises(CheckpointError, match="F64"):
        mlx_dtype("F64")
