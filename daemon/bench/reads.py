"""Read bandwidth measurements for `moed bench stream`: raw parallel `pread` of expert slices with
the page cache dropped (what the device gives), and a sweep of the store's own read path over
worker counts and chunk sizes in bursts the size of a decode step's misses."""

from __future__ import annotations

import mmap
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

from moed.daemon.experts.memory_plan import _EXPERT_TENSOR
from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.safetensors_index import CheckpointIndex
from moed.daemon.experts.store import (
    ExpertStore,
    ReadJob,
    _split,
    aligned_span,
    drop_page_cache,
    open_direct,
    open_for_reads,
)

SWEEP_WORKERS = (2, 4, 8, 16)
SWEEP_CHUNKS = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
SWEEP_ROUNDS = 3


def _random_experts(index: CheckpointIndex, seed: int) -> list[list]:
    """Every expert of the checkpoint as its list of tensor locations, in a random order."""
    owners: dict[str, list] = {}
    for name, loc in index.tensors.items():
        m = _EXPERT_TENSOR.match(name)
        if m:
            owners.setdefault(m.group("owner"), []).append(loc)
    experts = [
        [(loc, e) for loc in locs] for locs in owners.values() for e in range(locs[0].shape[0])
    ]
    random.Random(seed).shuffle(experts)
    return experts


def raw_pread_bandwidth(model_path: Path, workers: int, sample_bytes: int, seed: int = 0) -> dict:
    """What the device gives: parallel pread of expert-sized slices (every tensor of randomly
    chosen experts) with the page cache dropped, through the page cache and with O_DIRECT (where
    the file system has it), the two in an order alternating by seed; the better one is the
    reference (the store reads with O_DIRECT on Linux when it bypasses the cache). The two read
    different experts: a VM's host may cache its disk image, and a second read of the same bytes
    came back up to 30% faster here."""
    ways = [False, True] if seed % 2 else [True, False]
    results = {
        direct: _raw_pread(model_path, workers, sample_bytes, seed + 7919 * direct, direct)
        for direct in ways
    }
    best = max((r for r in results.values() if r), key=lambda r: r["mb_s"])
    out = dict(best)
    out["buffered_mb_s"], out["direct_mb_s"] = (
        results[d]["mb_s"] if results[d] else None for d in (False, True)
    )
    return out


def _raw_pread(model_path: Path, workers: int, sample_bytes: int, seed: int, direct: bool):
    """One raw measurement; None when O_DIRECT is asked for and refused. O_DIRECT reads the
    aligned span around each slice into page-aligned buffers and counts the span's bytes."""
    index = CheckpointIndex(model_path)
    jobs, total = [], 0
    for expert in _random_experts(index, seed):
        for loc, e in expert:
            off, n = loc.expert_range(e)
            jobs.append((loc.file, *(aligned_span(off, n) if direct else (off, n))))
            total += n
        if total >= sample_bytes:
            break

    drop_page_cache(index.files)
    # The store's own ways to open: random-access advice (F_NOCACHE on macOS), or O_DIRECT.
    fds = {f: open_direct(f) if direct else open_for_reads(f, True) for f in index.files}
    if None in fds.values():
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
        return None
    size = max(n for _, _, n in jobs)
    bufs = [mmap.mmap(-1, size) for _ in range(workers)]  # page aligned, as O_DIRECT wants
    local = threading.local()
    counter = iter(range(workers))
    lock = threading.Lock()

    def read(job):
        if not hasattr(local, "buf"):
            with lock:
                local.buf = memoryview(bufs[next(counter)])
        f, off, n = job
        return os.preadv(fds[f], [local.buf[:n]], off)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = sum(pool.map(read, jobs))
        wall = time.perf_counter() - t0
    except OSError:
        if not direct:
            raise
        return None  # the device wants a larger alignment than a page
    finally:
        for fd in fds.values():
            os.close(cast(int, fd))  # none is None: checked on opening
    return {
        "bytes": done,
        "seconds": wall,
        "mb_s": done / wall / 1e6,
        "reads": len(jobs),
        "workers": workers,
    }


def burst_bandwidth(
    model_path: Path, workers: int, chunk: int, burst: int, sample_bytes: int, seed: int = 0
) -> float:
    """MB/s of the store's own read path (ExpertStore jobs cut in `chunk`-byte pieces, ReadPool
    workers, pages dropped once per burst) reading `burst` random experts at a time, as a decode
    step's misses arrive, page cache dropped first: bytes over the time spent waiting."""
    index = CheckpointIndex(model_path)
    experts = _random_experts(index, seed)
    expert_bytes = sum(loc.expert_stride for loc, _ in experts[0])
    slots = [bytearray(expert_bytes) for _ in range(burst)]
    drop_page_cache(index.files)
    store = ExpertStore(index.files, bypass_page_cache=True, split_bytes=chunk)
    reader = ReadPool(store, workers)
    done = waited = 0.0
    try:
        for start in range(0, len(experts), burst):
            if done >= sample_bytes:
                break
            jobs = []
            for slot, expert in zip(slots, experts[start : start + burst]):
                view, pos = memoryview(slot), 0
                for loc, e in expert:
                    n = loc.expert_stride
                    job = ReadJob(
                        store.fds[loc.file], loc.expert_range(e)[0], [view[pos : pos + n]], n
                    )
                    jobs += _split(job, chunk)
                    pos += n
            res = reader.read(jobs)
            done += res.bytes_read
            waited += res.wall_s
    finally:
        reader.close()
        store.close()
    return done / waited / 1e6 if waited else 0.0


def sweep(
    model_path: Path, burst: int, sample_bytes: int, seed: int = 0, rounds: int = SWEEP_ROUNDS
) -> dict:
    """Burst read bandwidth for every (workers, chunk) of the sweep grid: the median of `rounds`
    rounds, each over the whole grid, so a drift of the machine hits every cell alike."""
    cells = [(w, c) for w in SWEEP_WORKERS for c in SWEEP_CHUNKS]
    samples: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    for r in range(rounds):
        for i, (w, c) in enumerate(cells):
            seed_i = seed + r * len(cells) + i
            samples[(w, c)].append(burst_bandwidth(model_path, w, c, burst, sample_bytes, seed_i))
    return {cell: statistics.median(v) for cell, v in samples.items()}


def sweep_report(results: dict, raw_mb_s: float, burst: int) -> str:
    lines = [
        f"read path sweep: {burst} random experts per burst (a decode step's misses), page cache "
        f"dropped; MB/s, median of {SWEEP_ROUNDS} rounds over the grid (x raw {raw_mb_s:.0f} MB/s)",
        f"{'workers':>8}  " + "  ".join(f"{f'{c >> 10} KiB chunks':>20}" for c in SWEEP_CHUNKS),
    ]
    best = max(results, key=lambda cell: results[cell])
    for w in SWEEP_WORKERS:
        cells = []
        for c in SWEEP_CHUNKS:
            v = results[(w, c)]
            mark = "*" if (w, c) == best else " "
            cells.append(f"{v:>11.0f} ({v / raw_mb_s:4.2f}){mark}")
        lines.append(f"{w:>8}  " + "  ".join(f"{cell:>20}" for cell in cells))
    lines.append(f"best: {best[0]} workers, {best[1] >> 10} KiB chunks (*)")
    return "\n".join(lines)
