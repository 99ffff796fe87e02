"""The eviction policy registry: one set of classes that the daemon's slot pools, `moed trace
analyze` and the configuration share; unknown names are configuration errors naming the allowed."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from moed.daemon.config import ConfigError, load_config
from moed.daemon.experts.policies import (
    POLICIES,
    AllProtectedError,
    UnknownPolicyError,
    make_policy,
    policy_names,
)
from moed.daemon.experts.slots import SlotTable
from moed.daemon.telemetry.analyze import simulate, simulate_belady
from tests.fixtures.daemon_harness import moed


def test_config_accepts_registered_names_and_rejects_others(tmp_path):
    for name in policy_names():
        cfg = load_config(
            tmp_path / "none.toml", environ={}, serve_overrides={"cache_policy": name}
        )
        assert cfg.serve.cache_policy == name
    (tmp_path / "c.toml").write_text('[serve]\ncache_policy = "fifo"\n')
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "c.toml", environ={})
    assert "cache_policy" in str(err.value) and "'fifo'" in str(err.value)
    assert all(name in str(err.value) for name in policy_names())
    with pytest.raises(ConfigError):
        load_config(tmp_path / "none.toml", environ={"MOED_CACHE_POLICY": "nope"})
    with pytest.raises(UnknownPolicyError):
        make_policy("nope", 8, 2)


@pytest.mark.process
def test_serve_flag_lists_the_policies():
    out = moed("serve", "--cache-policy", "nope", timeout=60)
    assert out.returncode == 2 and all(name in out.stderr for name in policy_names())


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_keeps_the_slot_table_consistent(name):
    """Random calls, passes and failed reads: the table and the policy agree on who is resident,
    the current pass's experts are never evicted, and no policy beats Belady's optimum."""
    rng = random.Random(3)
    E = 24
    for slots in (1, 3, 8, 24):
        table = SlotTable(E, slots, make_policy(name, E, slots))
        calls = [
            np.array(sorted(rng.sample(range(E), rng.choice([1, 2, 4, 9])))) for _ in range(80)
        ]
        for needed in calls:
            for chunk in table.plan_passes(needed):
                hits, loads = table.admit(chunk)
                assert sorted(hits + [e for e, _ in loads]) == sorted(chunk.tolist())
                assert all(table.slot_of[e] >= 0 for e in chunk)  # the pass's experts all stay
                if loads and rng.random() < 0.1:
                    table.forget(loads[:1])  # a failed read gives its slot back
            assert sorted(table.resident) == sorted(table.policy.order())
            assert len(table.resident) + table.free_slots == slots
        moves = table.resize_table(max(1, slots // 2))
        assert sorted(e for e, _, _ in moves) == sorted(table.resident)
        hits, misses = simulate(calls, slots, make_policy(name, E, slots))
        assert hits <= simulate_belady(calls, slots)[0]
        assert hits + misses == sum(len(c) for c in calls)


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_fully_protected_cache_refuses_to_evict(name):
    policy = make_policy(name, 4, 2)
    policy.begin_call()
    policy.insert(0)
    policy.insert(1)
    with pytest.raises(AllProtectedError):
        policy.victim({0, 1})


def calls(*sets):
    return [np.array(sorted(s), dtype=np.int64) for s in sets]


def test_lfu_counts_uses_and_forgets_them_with_its_half_life():
    # Expert 0 used in three calls long ago, expert 1 once, recently; 2 slots, then 2 arrives.
    seq = calls({0}, {0}, {0}, {1}, *[set()] * 6, {1}, {2}, {0})
    # A long memory keeps the frequent expert 0: evicts 1 for 2, and the last call hits 0.
    assert simulate(seq, 2, make_policy("lfu", 4, 2, half_life=1000.0)) == (4, 3)
    # A short one has forgotten 0's uses: 1 (used lately) stays, 0 is evicted and missed again.
    assert simulate(seq, 2, make_policy("lfu", 4, 2, half_life=0.5)) == (3, 4)


def test_lfu_victims_rank_by_score_then_last_use_then_id():
    """The victims are the residents outside the call in the order (score, last use, id), one
    victim or several, ties included (experts loaded together and never used again tie)."""
    rng = random.Random(5)
    for _ in range(30):
        E, slots = 32, rng.choice([4, 8, 16])
        policy = make_policy("lfu", E, slots, half_life=rng.choice([1.0, 4.0, math.inf]))
        table = SlotTable(E, slots, policy)
        for _ in range(rng.randrange(1, 60)):
            needed = np.array(sorted(rng.sample(range(E), rng.choice([1, 2, 3, slots]))))
            for chunk in table.plan_passes(needed):
                table.admit(chunk)
        protected = rng.sample(table.resident, rng.randrange(0, len(table.resident)))
        candidates = [e for e in table.resident if e not in protected]
        ranked = sorted(candidates, key=lambda e: (policy._score[e], policy._last[e], e))
        for count in range(1, len(candidates) + 1):
            assert policy.victims(count, np.array(protected, dtype=np.int64)) == ranked[:count]
            assert policy.victims(count, set(protected)) == ranked[:count]
        with pytest.raises(AllProtectedError):
            policy.victims(len(candidates) + 1, protected)


@pytest.mark.parametrize("name", list(POLICIES))
def test_all_hit_calls_told_later_change_no_decision(name):
    """The decode path tells the policy of all-hit calls in batches (SlotTable.touch_call) and
    the LFU policy ranks its victims from a heap: over random calls, long enough for LFU to
    rescale its scores, a table driven that way admits exactly as one told of every call at once,
    and its list mirror of the slot table never disagrees with the array."""
    rng = random.Random(11)
    E, slots = 32, 8
    kwargs = {"half_life": 1.0} if name == "lfu" else {}
    batched = SlotTable(E, slots, make_policy(name, E, slots, **kwargs))
    direct = SlotTable(E, slots, make_policy(name, E, slots, **kwargs))
    for _ in range(1500):
        needed = sorted(rng.sample(range(E), rng.choice([1, 2, 4, 8])))
        if all(batched.slot_list[e] >= 0 for e in needed):
            batched.touch_call(needed)
        else:
            batched.begin_call()
            batched.admit(needed)
        for chunk in direct.plan_passes(np.array(needed)):
            direct.admit(chunk)
        assert batched.slot_of.tolist() == direct.slot_of.tolist() == batched.slot_list
    assert batched.policy.order() == direct.policy.order()


def test_slru_keeps_reused_experts_through_a_scan():
    # 0 and 1 are used twice (protected), then a scan of one-time experts passes through.
    seq = calls({0}, {1}, {0}, {1}, {2}, {3}, {4}, {5}, {0}, {1})
    slru = simulate(seq, 3, make_policy("slru", 8, 3, protected_share=0.67))
    lru = simulate(seq, 3, make_policy("lru", 8, 3))
    assert slru == (4, 6) and lru == (2, 8)


@pytest.mark.slow
def test_bench_policy_on_recorded_traces(tmp_path):
    """Held-out replays of committed demo-model traces: a column per policy, nothing beats
    Belady, parameters come from the policies' grids."""
    import json
    import shutil

    from click.testing import CliRunner

    from moed.daemon.bench.policy import TRACES, policy

    for f in sorted(TRACES.glob("*.moetrace"))[:3]:
        shutil.copy(f, tmp_path / f.name)
    out = CliRunner().invoke(policy, ["--traces", str(tmp_path), "--shares", "0.25,0.5", "--json"])
    assert out.exit_code == 0, out.output
    res = json.loads(out.output)
    assert len(res["traces"]) == 3 and res["sizes"] == [8, 16]  # the demo model: 32 experts
    for name in [*policy_names(), "belady"]:
        assert len(res[name]) == 2
    for i in range(2):
        assert all(res[n][i]["hit_rate"] <= res["belady"][i]["hit_rate"] for n in policy_names())
        for name in policy_names():
            grid = POLICIES[name].PARAM_GRID
            assert all(res[name][i]["params"][k] in grid[k] for k in grid)
