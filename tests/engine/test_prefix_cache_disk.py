"""The prefix cache's SSD tier, in-process: entries survive the engine (the next engine reads its
prefix from the SSD, with the tokens of the cache off); a corrupt, truncated or foreign entry, a
full disk and a read-only folder each give one warning and the request is served."""

from __future__ import annotations

import logging
import subprocess
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from moed.daemon.config import ServeConfig
from moed.daemon.engine.core import EngineCore
from moed.daemon.engine.prefix_cache import disk_writer
from moed.daemon.engine.prefix_cache.disk_tier import Activity, DiskTier
from moed.daemon.engine.prefix_cache.entry import PrefixEntry
from moed.daemon.engine.status import EngineStatus
from tests.fixtures.engine_driver import SYSTEM, TURNS, ListSink, converse


def engine(model, state, disk_dir=None, prefix="64MB", disk="64MB", resident=True) -> EngineCore:
    serve = ServeConfig(
        model=str(model),
        state_dir=state,
        resident=resident,
        cache_budget="25%",
        prefix_cache_bytes=prefix,
        prefix_cache_disk_bytes=disk,
        prefix_cache_dir=str(disk_dir or ""),
        prefill_chunk=8,
        prefix_checkpoint_tokens=8,
    )
    core = EngineCore(serve, model, ListSink(), EngineStatus())
    assert core.load()
    return core


def finish(core: EngineCore) -> dict:
    """Let the SSD writer land everything, then close; returns the last prefix-cache counters."""
    core.prefix.cache.disk.flush()
    snap = core.prefix.cache.snapshot()
    core.close()
    return snap


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def expected(tiny_model, tmp_path):
    off = engine(tiny_model, tmp_path / "off", prefix="0", disk="0")
    out = converse(off, TURNS)
    off.close()
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "streaming"])
def test_the_next_engine_reads_its_prefix_from_the_ssd(
    checkpoint_factory, tmp_path, arch, resident
):
    model = checkpoint_factory(arch)
    off = engine(model, tmp_path / "off", prefix="0", disk="0", resident=resident)
    want = converse(off, TURNS)
    off.close()
    first = engine(model, tmp_path, resident=resident)
    got = converse(first, TURNS[:2])
    written = finish(first)
    assert written["disk_writes"] > 0 and written["disk_entries"] > 0
    second = engine(model, tmp_path, resident=resident)  # a restart: the memory tier is empty
    assert second.prefix.cache.snapshot()["memory_entries"] == 0
    got += converse(second, TURNS[2:], first_id=2)
    snap = finish(second)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert snap["disk_loads"] >= 1 and got[2][1] >= len(SYSTEM) - 1, (got, snap)


def test_the_ssd_tier_stays_in_budget_least_recent_out_first(tiny_model, tmp_path):
    prompts = [[(k * 29 + i * 3) % 250 + 3 for i in range(40)] for k in range(5)]
    core = engine(tiny_model, tmp_path, disk="60kB")
    converse(core, prompts)
    snap = finish(core)
    assert snap["disk_evictions"] > 0 and snap["disk_bytes"] <= 60_000
    again = engine(tiny_model, tmp_path, disk="60kB")
    got = converse(again, [prompts[-1], prompts[0]], first_id=10)
    finish(again)
    assert got[0][1] > 0 and got[1][1] == 0  # the newest is on the SSD, the oldest is gone


def _entry_files(core_or_dir):
    return sorted(p for p in core_or_dir.glob("*.safetensors") if not p.name.startswith("."))


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "garbage", "foreign"])
def test_a_damaged_or_foreign_entry_is_skipped_with_one_warning(
    tiny_model, checkpoint_factory, tmp_path, expected, caplog, damage
):
    disk = tmp_path / "cache"
    if damage == "foreign":  # another model's entries in the same folder
        other = engine(checkpoint_factory("qwen3_moe", seed=3), tmp_path / "o", disk_dir=disk)
        converse(other, TURNS[:1])
        finish(other)
        assert _entry_files(disk)
    else:
        first = engine(tiny_model, tmp_path, disk_dir=disk)
        converse(first, TURNS[:1])
        finish(first)
        for path in _entry_files(disk):
            data = bytearray(path.read_bytes())
            if damage == "corrupt":  # a flipped byte in the arrays, the header intact
                data[-5] ^= 0xFF
            elif damage == "truncated":
                data = data[: len(data) // 2 + 8]
            else:
                data = bytearray(b"not a safetensors file")
            path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="moed.prefix_cache")
    core = engine(tiny_model, tmp_path, disk_dir=disk)
    got = converse(core, TURNS)
    snap = finish(core)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert got[0][1] == 0  # nothing usable was on the SSD
    assert snap["disk_skipped"] >= 1
    skipped = [w for w in warnings_of(caplog) if "skipping" in w or "skipped" in w]
    assert len(skipped) == 1, warnings_of(caplog)


@pytest.fixture
def tiny_mount(tmp_path):
    """A tmpfs of the given size (root on Linux), unmounted after the test."""
    mounted = []

    def make(size: str, read_only: bool = False):
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        try:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)],
                check=True,
                capture_output=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot mount a tmpfs here: {exc}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


@pytest.mark.process
@pytest.mark.parametrize("where", ["full", "read_only"])
def test_a_full_disk_or_read_only_folder_warns_once_and_serves(
    tiny_model, tmp_path, expected, tiny_mount, caplog, where
):
    point = tiny_mount("16k") if where == "full" else tiny_mount("1m", read_only=True)
    disk = point / "cache" if where == "full" else point
    caplog.set_level(logging.WARNING, logger="moed.prefix_cache")
    core = engine(tiny_model, tmp_path, disk_dir=disk)
    got = converse(core, TURNS)
    snap = finish(core)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert all(c > 0 for _, c in got[1:])  # the memory tier still serves
    assert snap["disk_writes"] == 0 and snap["disk_entries"] == 0
    warned = [w for w in warnings_of(caplog) if "cannot" in w]
    assert len(warned) == 1, warnings_of(caplog)
    assert not [p for p in point.rglob("*") if p.is_file()]  # no temporary file left behind


def test_an_idle_unload_keeps_the_ssd_tier_and_the_reload_reads_from_it(
    tiny_model, tmp_path, expected
):
    core = engine(tiny_model, tmp_path)
    got = converse(core, TURNS[:2])
    core.prefix.cache.disk.flush()
    core.unload()  # what the keep-alive does: model, expert cache and memory tier released
    assert core.prefix.cache is None and core.status.get("prefix_cache") is None
    assert core.load()
    assert core.prefix.cache.snapshot()["memory_entries"] == 0
    got += converse(core, TURNS[2:], first_id=2)
    snap = finish(core)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert snap["disk_loads"] >= 1 and got[2][1] >= len(SYSTEM)


def _tier(tmp_path, trimmable=(True,)):
    return DiskTier(tmp_path / "tier", 64 << 20, "f" * 32, trimmable)


@pytest.fixture
def tier(tmp_path):
    """An SSD tier of attention-only entries; closed after the test (its writer thread ends)."""
    made = _tier(tmp_path)
    yield made
    made.close()


def _entry(tokens) -> PrefixEntry:
    cache = KVCache()
    n = len(tokens)
    cache.update_and_fetch(mx.ones((1, 1, n, 4)), mx.ones((1, 1, n, 4)))
    mx.eval(cache.state)
    return PrefixEntry(np.asarray(tokens, dtype=np.int32), [cache])


def _wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_the_ssd_writer_waits_while_a_prompt_is_read_and_writes_a_turn_once(tier):
    tier.engine_is(Activity.PROMPT)  # a row is reading its prompt
    tier.write(_entry(range(3, 20)))  # that prompt's entry
    tier.write(_entry(range(3, 30)))  # the row's whole generation: covers the first
    time.sleep(0.3)
    assert tier.writes == 0 and not _entry_files(tier.dir)
    tier.engine_is(Activity.IDLE)
    assert _wait_for(lambda: tier.writes == 1)
    tier.flush()
    (only,) = tier.records()
    assert only.length == 27 and tier.writes == 1
    tier.write(_entry(range(100, 110)))  # nothing held: written at once
    assert _wait_for(lambda: tier.writes == 2)


def test_a_held_write_waits_at_most_hold_max_and_flush_and_close_write_whatever_the_hold(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(disk_writer, "HOLD_MAX_S", 0.2)
    tier = _tier(tmp_path)
    tier.engine_is(Activity.PROMPT)  # an engine that is never quiet
    tier.write(_entry(range(3, 20)))
    assert _wait_for(lambda: tier.writes == 1)  # a crash would lose at most HOLD_MAX_S of it
    monkeypatch.setattr(disk_writer, "HOLD_MAX_S", 60.0)
    tier.write(_entry(range(50, 60)))
    tier.flush()
    assert tier.writes == 2
    tier.write(_entry(range(70, 80)))
    tier.close()  # the queued entry lands before the writer leaves
    assert tier.writes == 3 and len(_entry_files(tier.dir)) == 3


def test_a_server_always_reading_a_prompt_still_writes_once_entries_pile_up(tier):
    tier.engine_is(Activity.PROMPT)
    for k in range(disk_writer.HOLD_QUEUE - 1):
        tier.write(_entry(range(100 * k + 3, 100 * k + 20)))  # unrelated prompts
    time.sleep(0.3)
    assert tier.writes == 0  # a few wait for the engine to be quiet
    tier.write(_entry(range(900, 920)))
    # One more makes HOLD_QUEUE: the oldest go out while the hold lasts, none is dropped.
    assert _wait_for(lambda: tier.writes >= 1)
    tier.close()  # the rest land before the writer leaves
    assert tier.writes == disk_writer.HOLD_QUEUE


def test_the_engine_tells_the_ssd_writer_when_prompts_are_read(checkpoint_factory, tmp_path):
    core = engine(checkpoint_factory("qwen3_5_moe"), tmp_path)
    events: list[tuple[str, object]] = []
    disk = core.prefix.cache.disk
    engine_is, write = disk.engine_is, disk.write

    def logged_activity(activity):
        said = [e for e in events if e[0] == "is"]
        if not said or said[-1][1] is not activity:  # the changes only
            events.append(("is", activity))
        engine_is(activity)

    def logged_write(entry):
        events.append(("write", len(entry.tokens)))
        write(entry)

    disk.engine_is, disk.write = logged_activity, logged_write
    prompt = SYSTEM + [40, 41, 42]
    converse(core, [prompt])
    finish(core)
    states = [e[1] for e in events if e[0] == "is"]
    assert states == [Activity.PROMPT, Activity.DECODE, Activity.IDLE], events
    # The prompt's entry is queued while its row reads it, the whole row's as it ends.
    at_prompt = events.index(("write", len(prompt) - 1))
    assert ("is", Activity.PROMPT) in events[:at_prompt]
    assert ("is", Activity.DECODE) in events[at_prompt:]


def test_writes_go_out_while_rows_decode_and_an_idle_engine_waits_a_moment(tier, monkeypatch):
    monkeypatch.setattr(disk_writer, "QUIET_S", 3.0)  # wide margins on a loaded machine
    tier.engine_is(Activity.PROMPT)
    tier.write(_entry(range(3, 20)))
    time.sleep(0.3)
    assert tier.writes == 0
    tier.engine_is(Activity.DECODE)  # its first token came: written now
    assert _wait_for(lambda: tier.writes == 1, timeout=2.5)
    tier.engine_is(Activity.IDLE)
    tier.write(_entry(range(3, 40)))  # the turn ended: its client's next may come at once
    time.sleep(0.3)
    assert tier.writes == 1
    tier.engine_is(Activity.PROMPT)  # it came: the entry waits for its first token
    time.sleep(0.5)
    assert tier.writes == 1
    tier.engine_is(Activity.IDLE)  # or for the engine to stay idle a moment
    time.sleep(0.3)
    assert tier.writes == 1
    assert _wait_for(lambda: tier.writes == 2)


def test_a_clear_drops_the_entries_still_queued_for_the_writer(tier):
    tier.write(_entry(range(3, 20)))
    tier.flush()
    tier.engine_is(Activity.PROMPT)
    tier.write(_entry(range(50, 70)))  # waits for the prompt's first token
    assert tier.clear() > 0
    tier.engine_is(Activity.DECODE)
    tier.flush()
    assert tier.writes == 1 and not tier.records() and not _entry_files(tier.dir)


def test_under_memory_pressure_the_queued_entries_are_written_at_once(tier):
    tier.engine_is(Activity.PROMPT)
    tier.write(_entry(range(3, 20)))
    time.sleep(0.3)
    assert tier.writes == 0
    tier.write_now()  # the shed: the memory tier let go, the queue must too
    assert _wait_for(lambda: tier.writes == 1)
    tier.write(_entry(range(50, 70)))  # urgency ends with the queue it was for
    time.sleep(0.3)
    assert tier.writes == 1
