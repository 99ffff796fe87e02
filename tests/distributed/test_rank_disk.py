"""A pipeline rank's SSD files of its layers (distributed/rank_disk.py), without a group: a
follower's store writes, reads back, forgets and clears in rank 0's order, reads a part still
queued from memory, refuses a corrupt or foreign file, keeps to its budget; rank 0's side records
the ops the followers apply."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

from moed.daemon.distributed.cache_ops import KEY_WORDS, CacheOp, key_of, key_words
from moed.daemon.distributed.rank_disk import FollowerDisk, LeaderDisk
from moed.daemon.engine.prefix_cache.entry import PrefixEntry

KEY = "0123456789abcdef0123456789abcdef"
TRIMMABLE = (True, False)  # an attention layer, then a linear-attention one


def layers(seed: int) -> list:
    rng = np.random.default_rng(seed)
    kv = KVCache()
    kv.update_and_fetch(
        mx.array(rng.standard_normal((1, 2, 5, 4)), dtype=mx.float32),
        mx.array(rng.standard_normal((1, 2, 5, 4)), dtype=mx.float32),
    )
    state = ArraysCache(2)
    state.cache = [mx.array(rng.standard_normal((1, 3)), dtype=mx.float32), None]
    state.cache[1] = mx.array(rng.standard_normal((1, 2)), dtype=mx.float32)
    mx.eval(kv.keys, kv.values, *state.cache)
    return [kv, state]


def arrays(caches: list) -> list[np.ndarray]:
    out = []
    for c in caches:
        state = c.state if isinstance(c.state, (list, tuple)) else [c.state]
        out += [np.array(a) for a in state if isinstance(a, mx.array)]
    return out


def same(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(arrays(a), arrays(b), strict=True))


def store(tmp_path, budget=1 << 30, fingerprint="f" * 32) -> FollowerDisk:
    return FollowerDisk(tmp_path / "rank1of2", budget, fingerprint, TRIMMABLE)


def test_a_part_written_reads_back_after_a_restart_and_goes_when_forgotten(tmp_path):
    disk = store(tmp_path)
    part, checkpoint = layers(1), [layers(2)[1]]
    disk.write(KEY, part, [checkpoint])
    disk.close()  # a clean stop writes what is queued
    again = store(tmp_path)
    got = again.load(KEY, 1)
    assert got is not None and same(got[0], part) and same(got[1][0], checkpoint)
    assert again.snapshot()["disk_entries"] == 1
    again.forget(KEY)
    again.close()
    assert store(tmp_path).load(KEY, 1) is None


def test_a_part_still_queued_is_read_from_memory_and_clear_removes_everything(tmp_path):
    disk = store(tmp_path)
    with disk._wake:  # the writer cannot take it while this thread holds the queue's lock
        disk.write(KEY, layers(3), [])
        got = disk.load(KEY, 0)
        assert not (tmp_path / "rank1of2" / f"{KEY}.safetensors").exists()  # not on disk yet
    assert got is not None and same(got[0], layers(3))
    other = "f" * 32
    disk.write(other, layers(4), [])
    disk.clear()
    disk.close()
    assert not list((tmp_path / "rank1of2").glob("*.safetensors"))


def test_a_corrupt_or_foreign_file_is_refused_with_a_warning(tmp_path, caplog):
    other = "e" * 32
    disk = store(tmp_path)
    disk.write(KEY, layers(5), [])
    disk.write(other, layers(5), [])
    disk.close()
    path = tmp_path / "rank1of2" / f"{KEY}.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    foreign = store(tmp_path, fingerprint="e" * 32)  # another model's files
    assert foreign.load(other, 0) is None
    foreign.close()
    disk = store(tmp_path)
    assert disk.load(KEY, 0) is None  # its checksum
    disk.close()
    assert caplog.text.count("cannot read") == 2


def test_the_backstop_budget_removes_the_oldest_parts(tmp_path):
    size = store(tmp_path)
    size.write(KEY, layers(6), [])
    size.close()
    one = size.snapshot()["disk_bytes"]
    disk = FollowerDisk(tmp_path / "small", one, "f" * 32, TRIMMABLE)  # room for 2 (its slack)
    keys = [f"{i:032x}" for i in range(4)]
    for k in keys:
        disk.write(k, layers(7), [])
    disk.close()
    left = {p.stem for p in (tmp_path / "small").glob("*.safetensors")}
    assert left and len(left) <= 2 and keys[-1] in left, left


class RecordingLeader:
    def __init__(self, trimmable):
        self.trimmable = trimmable
        self.ops: list[tuple] = []

    def cache_trimmable(self):
        return self.trimmable

    def record(self, op, *args):
        self.ops.append((op, *args))


class Handle:
    """Rank 0's element for the followers' layers, as an entry holds it."""

    nbytes = 0
    state: list = []

    def __init__(self, handle: int):
        self.handle = handle


def test_rank_0_records_the_followers_part_of_each_entry():
    assert key_of(key_words(KEY)) == KEY and len(key_words(KEY)) == KEY_WORDS
    tokens = np.arange(12, dtype=np.int32)
    # Followers that keep recurrent state: each checkpoint's list ends with their state's handle.
    leader = RecordingLeader((True, False, False))
    entry = PrefixEntry(tokens, [*layers(8), Handle(5)], {8: [layers(9)[1], Handle(6)]}, key=KEY)
    LeaderDisk(leader).persist(entry)
    # Followers whose layers all cut back: rank 0's checkpoint lists hold only its own states.
    attention = RecordingLeader((True, False, True))
    LeaderDisk(attention).persist(PrefixEntry(tokens, [*layers(8), Handle(5)], {8: [layers(9)[1]]}))
    LeaderDisk(leader).forget(KEY)
    LeaderDisk(leader).clear()
    assert leader.ops[0] == (CacheOp.PERSIST, *key_words(KEY), 5, 1, 6)
    assert attention.ops[0][-2:] == (5, 0)
    assert leader.ops[1:] == [(CacheOp.FORGET, *key_words(KEY)), (CacheOp.CLEAR_DISK,)]
