"""The expert store: safetensors offsets, coalesced preadv jobs, slot memory, page-cache policy."""

from __future__ import annotations

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model
from safetensors import safe_open

from moed.daemon.experts import CheckpointIndex, StreamingConfig, install_streaming
from moed.daemon.experts.cache import LayerPool, PooledTensor, alloc_slots
from moed.daemon.experts.loads import SlotLoads
from moed.daemon.experts.policies import LRUPolicy
from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.safetensors_index import TensorLoc
from moed.daemon.experts.store import (
    ExpertStore,
    PageCachePolicy,
    _advance,
    open_direct,
    resolve_page_cache,
)
from tests.fixtures.reference import MEMORY, decode, resident, streaming

STORE_PROMPT = [(5 * i + 1) % 300 + 3 for i in range(40)]


@pytest.mark.parametrize("bits", [None, 4])
def test_header_offsets_match_safetensors(checkpoint_factory, bits):
    path = checkpoint_factory("gpt_oss", bits=bits)
    index = CheckpointIndex(path)
    stacked = [loc for loc in index.tensors.values() if "experts." in loc.name]
    assert stacked
    for loc in stacked:
        with safe_open(str(loc.file), framework="numpy") as st:
            full = st.get_tensor(loc.name)
        assert tuple(full.shape) == loc.shape
        with open(loc.file, "rb") as f:
            for e in (0, 3, loc.shape[0] - 1):
                off, n = loc.expert_range(e)
                f.seek(off)
                assert f.read(n) == full[e].tobytes(), (loc.name, e)


def test_adjacent_misses_coalesce_into_one_preadv(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", bits=4)
    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model, path, StreamingConfig(cache_budget="100%", memory_bytes=MEMORY)
    )
    try:
        pool = streamer.pools[0]
        _hits, loads = pool.admit([2, 3, 5, 6, 7])
        jobs = streamer.store.jobs_for(pool, pool.stage(loads))
        assert len(jobs) == 2 * len(pool.tensors)  # runs 2-3 and 5-7 of each tensor
        assert sorted(len(j.buffers) for j in jobs) == [2] * len(pool.tensors) + [3] * len(
            pool.tensors
        )
        streamer.reader.read(jobs)
        _assert_slots_hold(pool, [2, 3, 5, 6, 7])  # exactly the experts' bytes from the file
    finally:
        streamer.close()


def test_reads_land_in_the_mlx_array_without_a_copy():
    loc = TensorLoc("x", None, "BF16", (4, 3, 8), 0, 4 * 3 * 8 * 2)
    arr = alloc_slots(loc, 2)
    assert arr.dtype == mx.bfloat16 and arr.shape == (2, 3, 8)
    view = memoryview(arr).cast("B")
    view[48:96] = np.full(24, 0x3F80, dtype=np.uint16).tobytes()  # bf16 1.0 into slot 1
    assert mx.all(arr[1] == 1).item() and mx.all(arr[0] == 0).item()


def test_advance_after_short_read():
    a, b = memoryview(bytearray(4)), memoryview(bytearray(6))
    rest = _advance([a, b], 5)
    assert [len(v) for v in rest] == [5]
    assert _advance([a, b], 4) == [b]


def test_page_cache_policy():
    assert resolve_page_cache(PageCachePolicy.BYPASS, 1, 100) is True
    assert resolve_page_cache(PageCachePolicy.TRUST, 10**12, 100) is False
    assert resolve_page_cache(PageCachePolicy.AUTO, 60, 100) is True
    assert resolve_page_cache(PageCachePolicy.AUTO, 40, 100) is False
    assert resolve_page_cache("auto", 40, 100) is False


@pytest.mark.parametrize("policy", [PageCachePolicy.BYPASS, PageCachePolicy.TRUST])
def test_page_cache_modes_give_identical_tokens(checkpoint_factory, policy):
    path = checkpoint_factory("mixtral")
    want = decode(resident(path), STORE_PROMPT, 8)
    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model, path, StreamingConfig(cache_budget="25%", page_cache=policy, memory_bytes=MEMORY)
    )
    mx.eval(model.parameters())
    try:
        snap = streamer.snapshot()
        assert snap["page_cache_bypass"] is (policy is PageCachePolicy.BYPASS)
        # O_DIRECT wherever the file system has it, and only when bypassing.
        fd = open_direct(streamer.index.files[0])
        if fd is not None:
            os.close(fd)
        assert snap["direct_io"] is (policy is PageCachePolicy.BYPASS and fd is not None)
        assert decode(model, STORE_PROMPT, 8) == want
    finally:
        streamer.close()


def test_failed_read_raises_and_leaves_no_stale_slot(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe")
    path = tmp_path / "ck"
    shutil.copytree(src, path)
    model, streamer = streaming(path, "50%")
    try:
        loc = streamer.pools[1].tensors[0].loc
        os.truncate(loc.file, loc.offset)  # experts of the last layer are gone
        with pytest.raises(OSError):
            decode(model, STORE_PROMPT, 8)
        assert all(streamer.pools[1].slot_of[e] < 0 for e in range(8))
    finally:
        streamer.close()


def test_failed_read_in_a_decode_call_defers_nothing(checkpoint_factory, tmp_path, monkeypatch):
    """A one-pass decode call builds its graph while its misses are read: when a read fails, the
    call raises, gives its slots back, and its output was never handed to the fence."""
    src = checkpoint_factory("qwen3_moe")
    path = tmp_path / "ck"
    shutil.copytree(src, path)
    model, streamer = streaming(path, "50%")
    failed = []
    one_pass = SlotLoads.one_pass

    def spy(self, layer, *args):
        try:
            return one_pass(self, layer, *args)
        except OSError:
            failed.append(layer)
            raise

    monkeypatch.setattr(SlotLoads, "one_pass", spy)
    try:
        loc = streamer.pools[1].tensors[0].loc
        os.truncate(loc.file, loc.offset)  # the tensors stored from there on are gone
        with pytest.raises(OSError):
            decode(model, STORE_PROMPT[:1], 8)  # one token a call: the one-pass path
        assert len(failed) == 1  # the first failed read ends the step
        # The read-back before the failed call took every earlier output; its own never came.
        assert streamer.fence.outputs == []
        pool = streamer.pools[failed[0]]
        assert len(pool.resident) == pool.slots - pool.free_slots
    finally:
        streamer.close()


def test_lru_policy_and_pool_admission():
    loc = TensorLoc("w", None, "F32", (6, 2, 2), 0, 6 * 16)
    pool = LayerPool(0, [PooledTensor("gate_proj", "weight", loc)], 6, 3, LRUPolicy())
    hits, loads = pool.admit([0, 1, 2])
    assert hits == [] and [e for e, _ in loads] == [0, 1, 2]
    hits, loads = pool.admit([0])  # 0 becomes most recent
    assert hits == [0] and loads == []
    hits, loads = pool.admit([3, 4])  # evicts 1 then 2 (least recent, not wanted)
    assert sorted(pool.resident) == [0, 3, 4]
    assert pool.policy.order() == [0, 3, 4]
    with pytest.raises(ValueError):
        pool.admit([1, 2, 3, 5])
    released = pool.resize(1)
    assert released == 2 * pool.expert_bytes and pool.resident == [4]


def test_split_large_jobs_into_chunks():
    from moed.daemon.experts.store import ReadJob, _split

    a, b = bytearray(10), bytearray(7)
    job = ReadJob(3, 100, [memoryview(a), memoryview(b)], 17)
    pieces = _split(job, 6)
    assert [p.offset for p in pieces] == [100, 106, 112]
    assert [p.nbytes for p in pieces] == [6, 6, 5]
    assert [[len(v) for v in p.buffers] for p in pieces] == [[6], [4, 2], [5]]
    assert sum(len(v) for p in pieces for v in p.buffers) == 17
    assert _split(job, 0) == [job] and _split(job, 17) == [job]


class OrderedStore(ExpertStore):
    """A real store that also records the order in which jobs ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ran: list[int] = []

    def run(self, job):
        self.ran.append(job.offset)
        return super().run(job)


def test_demand_reads_go_first_and_speculative_ones_cancel(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", bits=4)
    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model, path, StreamingConfig(cache_budget="100%", memory_bytes=MEMORY)
    )
    store = OrderedStore(streamer.index.files, bypass_page_cache=False)
    reader = ReadPool(store, workers=1)
    try:
        pool = streamer.pools[0]
        _hits, loads = pool.admit([0, 1, 2, 3])
        spec = [store.jobs_for(pool, pool.stage([load])) for load in loads[:3]]
        demand = store.jobs_for(pool, pool.stage(loads[3:]))
        with reader._cv:  # the worker cannot take anything until all are queued
            spec_batches = [reader.submit(jobs, speculative=True) for jobs in spec]
            demand_batch = reader.submit(demand)
            reader.promote([spec_batches[1]])  # needed after all: to the front of the queue
            assert reader.cancel(spec_batches[2])  # not needed: never starts
        res = reader.wait([demand_batch, spec_batches[0], spec_batches[1]])
        # The promoted guess was queued first, so it leads; the other guess waits for demand.
        order = [j.offset for j in spec[1] + demand + spec[0]]
        assert store.ran == order
        assert res.jobs == len(order)
        cancelled = spec_batches[2]
        assert cancelled.started == 0 and cancelled.cancelled_bytes == sum(
            j.nbytes for j in spec[2]
        )
        for t in pool.tensors:  # the cancelled expert's slot was never written
            assert not any(bytes(pool.slot_view(t, loads[2][1])))
    finally:
        reader.close()
        store.close()
        streamer.close()


def _assert_slots_hold(pool, experts):
    """Each expert's slot holds exactly its bytes from the checkpoint (read with safetensors)."""
    for t in pool.tensors:
        with safe_open(str(t.loc.file), framework="numpy") as st:
            full = st.get_tensor(t.loc.name)
        for e in experts:
            assert bytes(pool.slot_view(t, int(pool.slot_of[e]))) == full[e].tobytes(), (t, e)


def _read_and_compare(store, pool, experts, workers=3):
    reader = ReadPool(store, workers=workers)
    try:
        _hits, loads = pool.admit(experts)
        jobs = store.jobs_for(pool, pool.stage(loads))
        reader.read(jobs)
        _assert_slots_hold(pool, experts)
        return jobs
    finally:
        reader.close()


def test_direct_reads_fill_slots_exactly_from_unaligned_offsets(checkpoint_factory):
    """Bypassing the page cache on Linux reads with O_DIRECT through an aligned bounce buffer:
    expert slices start anywhere in the file, runs of experts coalesce into one job with several
    slots, and the file's last expert ends at its end (the aligned read comes back short)."""
    path = checkpoint_factory("qwen3_moe", bits=4)
    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model, path, StreamingConfig(cache_budget="100%", memory_bytes=MEMORY)
    )
    store = ExpertStore(streamer.index.files, bypass_page_cache=True, split_bytes=4096)
    try:
        if not store.direct:
            pytest.skip("this file system refuses O_DIRECT (the buffered path is tested above)")
        assert not store.drop_after_read  # nothing enters the page cache: nothing to drop
        pool = streamer.pools[-1]
        last = pool.num_experts - 1
        ends = {
            t.loc.file.stat().st_size - (t.loc.offset + (last + 1) * t.loc.expert_stride)
            for t in pool.tensors
        }
        assert 0 in ends  # the file's last bytes are among the reads
        jobs = _read_and_compare(store, pool, [0, 1, 2, 4, last])
        assert any(j.offset % 4096 for j in jobs) and any(len(j.buffers) > 1 for j in jobs)
    finally:
        store.close()
        streamer.close()


def test_one_expert_read_split_into_chunks(checkpoint_factory):
    """A burst of one expert (a decode call's usual miss) gets one job per tensor, cut where a
    tensor is larger than a chunk; the slots hold the checkpoint's bytes."""
    path = checkpoint_factory("qwen3_moe", bits=4)
    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model, path, StreamingConfig(cache_budget="100%", memory_bytes=MEMORY)
    )
    pool = streamer.pools[0]
    chunk = min(t.slot_bytes for t in pool.tensors)
    store = ExpertStore(streamer.index.files, bypass_page_cache=False, split_bytes=chunk)
    try:
        jobs = _read_and_compare(store, pool, [3])
        assert all(j.nbytes <= chunk for j in jobs)
        assert len(jobs) > len(pool.tensors)  # some tensor was cut
        assert sum(j.nbytes for j in jobs) == pool.expert_bytes
    finally:
        store.close()
        streamer.close()


def test_refused_direct_read_falls_back_to_the_page_cache(checkpoint_factory, monkeypatch):
    """A device that wants a larger alignment refuses the O_DIRECT read with EINVAL (the real
    kernel's refusal: the alignment is forced to 1 byte here); that file is then read through the
    page cache and dropped after each burst, with the same bytes."""
    import moed.daemon.experts.store as store_mod

    path = checkpoint_factory("qwen3_moe", bits=4)
    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model, path, StreamingConfig(cache_budget="100%", memory_bytes=MEMORY)
    )
    monkeypatch.setattr(store_mod, "DIRECT_ALIGN", 1)
    store = ExpertStore(streamer.index.files, bypass_page_cache=True)
    try:
        if not store.direct:
            pytest.skip("this file system refuses O_DIRECT (the buffered path is tested above)")
        direct_fds = list(store.direct.values())
        jobs = _read_and_compare(store, streamer.pools[0], [3, 5])
        if any(j.offset % 512 and j.fd in store.direct for j in jobs):
            pytest.skip("this file system accepts unaligned O_DIRECT reads (tmpfs does)")
        assert not store.direct and store.drop_after_read
        store.close()
        for fd in direct_fds:  # the descriptors given up after the refusal are closed too
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        store.close()
        streamer.close()
