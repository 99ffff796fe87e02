"""Router traces: per forward pass and MoE layer, the experts each token chose and how each distinct
expert was served (cache hit, page-cache read, SSD read).

File format (`.moetrace`), version 1: a stream of msgpack objects, nothing else, so any language
with msgpack reads it (`msgpack.Unpacker` in Python).

1. Header, a map:
   `format` = "moed-trace", `version` = 1, `model`, `model_path`, `model_type`, `layers` (MoE
   layers, L), `top_k` (k), `experts` (per layer, E), `expert_bytes` (per layer), `budget_bytes`,
   `slots_per_layer`, `policy` (eviction policy class), `page_cache_bypass`, `id_dtype` ("u1" or
   "u2", little-endian), `classes` (["hit", "page_cache", "ssd", "read"]), `resident_at_start`
   (per layer, the cached experts before the first pass, least valuable first), `request`
   (`id`, `prompt_tokens`), `created` (unix seconds), `moed_version`.
2. One map per forward pass (a prefill chunk of N tokens, or one decode token with N = 1):
   - `n`: N, the token rows of this pass
   - `ids`: bytes, L*N*k expert ids in `id_dtype`, layer-major: layer l, token i, choice j at
     `(l*N + i)*k + j`
   - `cls`: bytes (u1), for each layer in order, one class per *distinct* expert of that layer in
     this pass, in ascending expert id (the same set `numpy.unique` gives for the layer's ids)
   - `ms`: wall milliseconds of the pass; `stall_ms`: waiting for expert reads; `router_ms`: reading
     the router's choices back to the host; `read_bytes`: expert bytes read.

Classes: `hit` (already in the expert cache), `page_cache` (a read whose pages were all in the OS
page cache, checked with mincore just before the read), `ssd` (a read that went to the device),
`read` (a read whose residency could not be checked).

Passes per request: the engine runs requests as one batch (engine/batch.py), and a request's trace
holds every forward pass of the batch while the request was in it: prompt chunks (up to
`prefill_chunk` rows per prompt being read) and decode passes (one row per decoding request), the
rows of the requests beside it included. A request alone has P + T token rows for P prompt and T
completion tokens (one more when the generator computed a token it did not return).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from moed.daemon import __version__
from moed.daemon.telemetry.residency import PageCacheProbe
from moed.daemon.telemetry.trace_file import TraceFile

log = logging.getLogger("moed.telemetry.trace")

FORMAT = "moed-trace"
VERSION = 1
HIT, PAGE_CACHE, SSD, READ = 0, 1, 2, 3
CLASSES = ["hit", "page_cache", "ssd", "read"]
SUFFIX = ".moetrace"
CHUNK_BYTES = 256 * 1024  # flush this much to the sink at a time (well under a wire frame)


# ---- reading ----------------------------------------------------------------------------------


@dataclass
class Pass:
    n: int
    ids: np.ndarray  # (L, N, k)
    classes: list[np.ndarray]  # per layer, one per distinct expert (ascending id)
    ms: float = 0.0
    stall_ms: float = 0.0
    router_ms: float = 0.0
    read_bytes: int = 0

    def experts(self, layer: int) -> np.ndarray:
        return np.unique(self.ids[layer])


@dataclass
class Trace:
    header: dict
    passes: list[Pass] = field(default_factory=list)

    @property
    def layers(self) -> int:
        return int(self.header["layers"])

    @property
    def top_k(self) -> int:
        return int(self.header["top_k"])

    @property
    def num_experts(self) -> list[int]:
        return list(self.header["experts"])

    @property
    def tokens(self) -> int:
        return sum(p.n for p in self.passes)

    def token_rows(self, layer: int) -> np.ndarray:
        """(tokens, k): the experts every token row chose in `layer`, in order."""
        if not self.passes:
            return np.zeros((0, self.top_k), dtype=np.int64)
        return np.concatenate([p.ids[layer] for p in self.passes]).astype(np.int64)

    def class_counts(self) -> dict[str, int]:
        counts = np.zeros(len(CLASSES), dtype=np.int64)
        for p in self.passes:
            for c in p.classes:
                counts += np.bincount(c, minlength=len(CLASSES))[: len(CLASSES)]
        return {name: int(n) for name, n in zip(CLASSES, counts)}


class TraceFormatError(ValueError):
    pass


def read_trace(path: str | Path) -> Trace:
    with open(path, "rb") as f:
        return parse_trace(f)


def parse_trace(stream) -> Trace:
    unpacker = msgpack.Unpacker(stream, raw=False, strict_map_key=True, max_buffer_size=256 << 20)
    try:
        header = next(unpacker)
    except StopIteration:
        raise TraceFormatError("empty trace") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceFormatError("not a moed trace (no moed-trace header)")
    if header.get("version") != VERSION:
        raise TraceFormatError(
            f"trace version {header.get('version')} is not supported (this reads {VERSION})"
        )
    dtype = np.dtype("<u2" if header.get("id_dtype") == "u2" else "u1")
    L, k = int(header["layers"]), int(header["top_k"])
    trace = Trace(header)
    for rec in unpacker:
        n = int(rec["n"])
        ids = np.frombuffer(rec["ids"], dtype=dtype)
        if ids.size != L * n * k:
            raise TraceFormatError(
                f"pass {len(trace.passes)}: {ids.size} ids, expected {L}*{n}*{k}"
            )
        ids = ids.reshape(L, n, k)
        cls = np.frombuffer(rec["cls"], dtype=np.uint8)
        classes, at = [], 0
        for layer in range(L):
            m = np.unique(ids[layer]).size
            classes.append(cls[at : at + m])
            at += m
        if at != cls.size:
            raise TraceFormatError(
                f"pass {len(trace.passes)}: {cls.size} classes for {at} distinct experts"
            )
        trace.passes.append(
            Pass(
                n,
                ids,
                classes,
                float(rec.get("ms", 0.0)),
                float(rec.get("stall_ms", 0.0)),
                float(rec.get("router_ms", 0.0)),
                int(rec.get("read_bytes", 0)),
            )
        )
    return trace


# ---- recording --------------------------------------------------------------------------------


@dataclass
class _OpenPass:
    t0: float
    counters0: tuple[float, float, int]
    ids: dict[int, np.ndarray] = field(default_factory=dict)
    cls: dict[int, dict[int, int]] = field(default_factory=dict)


class TraceRecorder:
    """The streamer's observer while one request's passes run (engine thread only).

    `on_route` and `on_load` are the ExpertStreamer hooks; `write(bytes)` receives whole msgpack
    objects in chunks of about CHUNK_BYTES; `close()` flushes the rest. `file` is the request's
    trace file among the writers, if any: its owner closes it after the recorder.
    """

    file: TraceFile | None

    def __init__(
        self,
        streamer: Any,
        header: dict,
        write: Callable[[bytes], object],
        chunk_bytes: int = CHUNK_BYTES,
        file: TraceFile | None = None,
    ):
        self.streamer = streamer
        self.layers = len(streamer.pools)
        self.header = header
        self._write = write
        self._chunk_bytes = chunk_bytes
        self._buf = bytearray()
        self._pass: _OpenPass | None = None
        self._header_done = False
        self._resident_at_start: list[list[int]] | None = None
        self._probe = PageCacheProbe()
        max_experts = max(p.num_experts for p in streamer.pools)
        self._dtype = np.dtype("<u1" if max_experts <= 256 else "<u2")
        self.passes = 0
        self.closed = False
        self.file = file

    # -- window: the engine attaches the recorder around one step of its request --------------

    def begin(self) -> None:
        if self._resident_at_start is None:
            self._resident_at_start = [
                list(map(int, p.policy.order())) for p in self.streamer.pools
            ]

    def end(self) -> None:
        self._close_pass()

    # -- ExpertStreamer hooks ----------------------------------------------------------------------

    def on_route(self, layer: int, host: np.ndarray) -> None:
        if layer == 0:
            self._close_pass()
            self._pass = _OpenPass(time.perf_counter(), self._counters())
        if self._pass is None:
            return
        self._pass.ids[layer] = np.asarray(host).reshape(-1, host.shape[-1]).copy()
        self._pass.cls[layer] = {}

    def on_load(self, layer: int, pool: Any, hits: list[int], loads: list[tuple[int, int]]) -> None:
        if self._pass is None or layer not in self._pass.cls:
            return
        classes = self._pass.cls[layer]
        for e in hits:
            classes[int(e)] = HIT
        for e, _slot in loads:
            classes[int(e)] = self._classify(pool, int(e))

    def _classify(self, pool: Any, expert: int) -> int:
        fractions = []
        for t in pool.tensors:
            stride = t.loc.expert_stride
            frac = self._probe.resident_fraction(t.loc.file, t.loc.offset + expert * stride, stride)
            if frac is None:
                return READ
            fractions.append(frac)
        return PAGE_CACHE if all(f >= 1.0 for f in fractions) else SSD

    # -- records -----------------------------------------------------------------------------------

    def _counters(self) -> tuple[float, float, int]:
        c = self.streamer.counters
        return c.stall_s, c.router_sync_s + c.router_copy_s, c.bytes_read

    def _close_pass(self) -> None:
        p, self._pass = self._pass, None
        if p is None or len(p.ids) != self.layers:
            return  # a pass that did not reach every layer (an error mid-pass) is dropped
        stall, router, read = (b - a for a, b in zip(p.counters0, self._counters()))
        n, k = p.ids[0].shape
        if not self._header_done:
            self._emit(
                {**self.header, "top_k": int(k), "resident_at_start": self._resident_at_start or []}
            )
            self._header_done = True
        ids = np.concatenate([p.ids[layer] for layer in range(self.layers)]).astype(self._dtype)
        cls = []
        for layer in range(self.layers):
            got = p.cls.get(layer, {})
            cls.extend(got.get(int(e), READ) for e in np.unique(p.ids[layer]))
        self._emit(
            {
                "n": int(n),
                "ids": ids.tobytes(),
                "cls": bytes(cls),
                "ms": round((time.perf_counter() - p.t0) * 1000.0, 4),
                "stall_ms": round(stall * 1000.0, 4),
                "router_ms": round(router * 1000.0, 4),
                "read_bytes": int(read),
            }
        )
        self.passes += 1

    def _emit(self, obj: dict) -> None:
        self._buf += msgpack.packb(obj, use_bin_type=True)
        if len(self._buf) >= self._chunk_bytes:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            data, self._buf = bytes(self._buf), bytearray()
            self._write(data)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._close_pass()
        if not self._header_done:  # no pass at all: still a valid (empty) trace
            self._emit(
                {**self.header, "top_k": 0, "resident_at_start": self._resident_at_start or []}
            )
            self._header_done = True
        self.flush()
        self._probe.close()


def trace_header(streamer: Any, model: dict, request: dict) -> dict:
    pools = streamer.pools
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": model.get("name"),
        "model_path": model.get("path"),
        "model_type": model.get("model_type"),
        "layers": len(pools),
        "experts": [int(p.num_experts) for p in pools],
        "expert_bytes": [int(p.expert_bytes) for p in pools],
        "budget_bytes": int(streamer.budget_bytes),
        "slots_per_layer": [int(p.slots) for p in pools],
        "pass_lane": streamer.lane_layers(),  # the replay's passes alternate with the lane
        "policy": pools[0].policy.name if pools else None,
        "page_cache_bypass": bool(streamer.bypass_page_cache),
        "id_dtype": "u1" if max((p.num_experts for p in pools), default=0) <= 256 else "u2",
        "classes": CLASSES,
        "request": request,
        "created": time.time(),
        "moed_version": __version__,
    }


@contextlib.contextmanager
def recording(recorder: TraceRecorder | None) -> Iterator[None]:
    """Attach `recorder` to its streamer for the duration of one engine step of its request."""
    if recorder is None:
        yield
        return
    recorder.begin()
    try:
        with recorder.streamer.steps.observing(recorder):
            yield
    finally:
        recorder.end()


class _Fanout:
    """One streamer observer that feeds every recorder of a batched step."""

    def __init__(self, recorders: list[TraceRecorder]):
        self.recorders = recorders

    def on_route(self, layer: int, host: np.ndarray) -> None:
        for r in self.recorders:
            r.on_route(layer, host)

    def on_load(self, layer: int, pool: Any, hits: list[int], loads: list[tuple[int, int]]) -> None:
        for r in self.recorders:
            r.on_load(layer, pool, hits, loads)


@contextlib.contextmanager
def recording_all(recorders: list[TraceRecorder]) -> Iterator[None]:
    """Attach several recorders (the traced requests of one batched step) to their streamer."""
    if not recorders:
        yield
        return
    if len(recorders) == 1:
        with recording(recorders[0]):
            yield
        return
    for r in recorders:
        r.begin()
    try:
        with recorders[0].streamer.steps.observing(_Fanout(recorders)):
            yield
    finally:
        for r in recorders:
            r.end()


# ---- the engine's side: one recorder per traced request ---------------------------------------


def record_steps(recorder: TraceRecorder, steps: Iterator) -> None:
    """Run a generation (an mlx-lm `generate_step` iterator) to its end, recording every step,
    then close the recorder (also when a step raises)."""
    try:
        while True:
            with recording(recorder):
                try:
                    next(steps)
                except StopIteration:
                    return
    finally:
        recorder.close()
