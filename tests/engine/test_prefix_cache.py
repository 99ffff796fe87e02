"""The prefix KV cache in the engine, in-process: a request that begins with a cached prefix reads
only the rest, and its tokens are the tokens of the same request with the cache off (greedy and
seeded, resident and streaming, attention-only qwen3_moe and hybrid qwen3_5_moe)."""

from __future__ import annotations

import pytest

from moed.daemon.config import ServeConfig
from moed.daemon.engine.commands import Shed
from moed.daemon.engine.core import EngineCore
from moed.daemon.engine.status import EngineStatus
from moed.daemon.model.prompt_normalize import normalize_messages
from moed.protocol import ShedLevel
from tests.fixtures.engine_driver import SYSTEM, TURNS, ListSink, converse, run_until_idle, submit
from tests.fixtures.matrix import first_fast


def engine(model, tmp_path, prefix: str, resident: bool, **extra) -> EngineCore:
    serve = ServeConfig(
        model=str(model),
        state_dir=tmp_path,
        resident=resident,
        cache_budget="25%",
        prefix_cache_bytes=prefix,
        prefix_cache_disk_bytes="0",
        prefill_chunk=8,
        prefix_checkpoint_tokens=8,  # a 40-token prompt: several recurrent-state checkpoints
        **extra,
    )
    core = EngineCore(serve, model, ListSink(), EngineStatus())
    assert core.load()
    return core


@pytest.mark.parametrize("arch", first_fast(["qwen3_moe", "qwen3_5_moe"]))
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "streaming"])
@pytest.mark.parametrize(
    "sampling", first_fast([{}, {"temperature": 0.9, "seed": 7}], ["greedy", "seed"])
)
def test_prefix_hits_give_the_tokens_of_the_cache_off(
    checkpoint_factory, tmp_path, arch, resident, sampling
):
    model = checkpoint_factory(arch)
    off = engine(model, tmp_path, "0", resident)
    expected = converse(off, TURNS, **sampling)
    assert off.status.get("prefix_cache") is None
    off.close()
    on = engine(model, tmp_path, "64MB", resident)
    got = converse(on, TURNS, **sampling)
    snap = on.status.get("prefix_cache")
    on.close()
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [c for _, c in expected] == [0] * len(TURNS)
    cached = [c for _, c in got]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    if arch == "qwen3_moe":  # attention layers cut back to the exact common prefix
        assert cached[1] == 30 and cached[2] == len(SYSTEM)
    else:  # recurrent state resumes from the nearest checkpoint (every 8 tokens, and the
        # first turn's answer kept its state once the prompt was read: ladder.py)
        assert cached[1] == 24 and cached[2] == len(SYSTEM)
    # the fourth turn extends the third: all of it but the last token's read is reused
    assert cached[3] >= len(TURNS[2]) - 1
    assert snap["hits"] == len(TURNS) - 1 and snap["tokens_reused"] == sum(cached)
    assert snap["memory_bytes"] > 0 and snap["hybrid"] is (arch != "qwen3_moe")


@pytest.mark.parametrize("resident", first_fast([False, True]), ids=["streaming", "resident"])
def test_a_turn_parting_from_the_last_answer_resumes_inside_it(
    checkpoint_factory, tmp_path, resident
):
    """A hybrid model's row decoding alone keeps its recurrent state behind its newest token
    (prefix_cache/ladder.py): a next turn that sends back only part of the answer (a client
    trimming it, a template writing it otherwise) resumes inside it, with the cache-off tokens."""
    model = checkpoint_factory("qwen3_5_moe")
    off = engine(model, tmp_path / "off", "0", resident)
    ((answer, _),) = converse(off, [SYSTEM])
    turns = [SYSTEM + answer[:k] + [5, 6, 7] for k in (3, 5)]
    expected = converse(off, turns, first_id=1)
    off.close()
    on = engine(model, tmp_path / "on", "64MB", resident)
    assert converse(on, [SYSTEM])[0][0] == answer
    got = converse(on, turns, first_id=1)
    on.close()
    assert [t for t, _ in got] == [t for t, _ in expected]
    # Without the ladder: the prompt's end (len(SYSTEM) - 1), the nearest checkpoint before.
    assert [c for _, c in got] == [len(SYSTEM) + 3, len(SYSTEM) + 5]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_batch_rows_hit_different_prefixes_independently(checkpoint_factory, tmp_path, arch):
    model = checkpoint_factory(arch)
    other = [(13 * i) % 190 + 5 for i in range(33)]
    warm = [SYSTEM, other]
    rows = [SYSTEM + [21, 22, 23], other[:20] + [31, 32], [50, 51, 52, 53]]
    off = engine(model, tmp_path, "0", True)
    expected = [t for t, _ in converse(off, rows)]
    off.close()
    on = engine(model, tmp_path, "64MB", True)
    converse(on, warm)
    for i, ids in enumerate(rows):  # all at once: one batch, each row with its own prefix
        submit(on, f"r{i}", ids, max_tokens=6)
    run_until_idle(on)
    assert on.status.get("peak_running_requests") == len(rows)
    dones = [on.sink.of(f"r{i}")[-1] for i in range(len(rows))]
    got = [on.sink.tokens(f"r{i}") for i in range(len(rows))]
    on.close()
    assert got == expected
    cached = [d["usage"]["cached_tokens"] for d in dones]
    assert cached[0] >= len(SYSTEM) - 1 and 0 < cached[1] <= 20 and cached[2] == 0, cached


def test_a_small_budget_evicts_least_recent_first_and_stays_exact(tiny_model, tmp_path):
    prompts = [[(k * 17 + i * 5) % 250 + 3 for i in range(40)] for k in range(4)]
    off = engine(tiny_model, tmp_path, "0", True)
    expected = converse(off, prompts + prompts[::-1])
    off.close()
    # Room for about two entries of this model (40-token prompts, 2 layers of float32 KV).
    on = engine(tiny_model, tmp_path, "60kB", True)
    got = converse(on, prompts + prompts[::-1])
    snap = on.status.get("prefix_cache")
    on.close()
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert snap["memory_evictions"] > 0 and snap["memory_bytes"] <= 60_000
    # The most recent prompt is still cached when asked again at once; the oldest is not.
    assert got[4][1] > 0 and got[7][1] == 0


def test_shed_empties_the_prefix_cache_first_and_a_later_request_is_served(tiny_model, tmp_path):
    core = engine(tiny_model, tmp_path, "64MB", False)
    first = converse(core, [SYSTEM])
    assert core.status.get("prefix_cache")["memory_bytes"] > 0
    core.handle(Shed(ShedLevel.CACHE))
    snap = core.status.get("prefix_cache")
    assert snap["memory_bytes"] == 0 and snap["memory_entries"] == 0
    assert core.status.get("last_shed").released_bytes > 0
    again = converse(core, [SYSTEM], first_id=1)
    core.close()
    assert again[0] == (first[0][0], 0)  # read in full again, same tokens


def test_the_claude_code_billing_line_is_normalized_away():
    header = "x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; cch=ab12;\n"
    turns = [{"role": "system", "content": header + "You are Claude Code."}]
    assert normalize_messages(turns) == [{"role": "system", "content": "You are Claude Code."}]
    kept = [
        {"role": "system", "content": "  You are helpful.\nx-anthropic-billing-header: x"},
        {"role": "user", "content": header},
    ]
    assert normalize_messages(kept) == kept  # only at the start of a system turn


def test_under_a_pipeline_a_set_size_is_the_groups_and_each_rank_plans_its_share(tmp_path):
    from moed.daemon.engine.prefix_cache.setup import memory_tier_bytes, prefix_cache_config
    from moed.daemon.experts.budget import parse_size
    from moed.daemon.model.loader import prefix_cache_memory_bytes

    serve = ServeConfig(state_dir=tmp_path, pipeline=2, prefix_cache_bytes="1GB")
    assert prefix_cache_memory_bytes(serve) == 10**9  # the whole group's, into the rank spec
    # Rank 0 counts only its own layers' caches: its share of the layers.
    assert memory_tier_bytes(serve, None, share=0.25) == 250_000_000
    cfg = prefix_cache_config(serve, None, share=0.5)
    # The SSD tier's size is the group's too: each rank's folder takes its share of the layers'.
    assert cfg.memory_bytes == 500_000_000 and cfg.disk_bytes == parse_size("10GB")
    alone = ServeConfig(state_dir=tmp_path, prefix_cache_bytes="1GB")
    assert prefix_cache_config(alone).disk_bytes > 0
    assert prefix_cache_memory_bytes(ServeConfig(state_dir=tmp_path)) is None  # auto: the plan's
