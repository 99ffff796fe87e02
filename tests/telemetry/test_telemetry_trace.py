"""Router traces: recorded by a real daemon (`moe run --trace`, `trace_dir`) and in-process, with
hit / page-cache / SSD classes checked against the cache counters and the page cache itself."""

from __future__ import annotations

import io

import msgpack
import numpy as np
import pytest

from moed.client import DoneEvent, TraceEvent
from moed.daemon.experts.policies import DEFAULT_POLICY
from moed.daemon.telemetry.trace import CLASSES, HIT, PAGE_CACHE, SSD, parse_trace, read_trace
from tests.fixtures.daemon_harness import moe

BUDGET = "25%"


@pytest.mark.process
def test_moe_run_trace_file_matches_the_cache_counters(tiny_model, daemon_factory, tmp_path):
    d = daemon_factory(tiny_model, "--cache-budget", BUDGET)
    with d.client() as c:
        before = c.stats()["experts"]
    out = moe(
        d.socket,
        "run",
        "--raw",
        "--max-tokens",
        "12",
        "--trace",
        str(tmp_path / "t.moetrace"),
        "hello world",
    )
    assert out.returncode == 0, out.stderr
    assert "router trace written to" in out.stderr
    with d.client() as c:
        after = c.stats()["experts"]
    trace = read_trace(tmp_path / "t.moetrace")
    h = trace.header
    assert (h["format"], h["version"], h["layers"], h["top_k"], h["experts"]) == (
        "moed-trace",
        1,
        2,
        2,
        [8, 8],
    )
    assert (
        h["slots_per_layer"] == [2, 2]
        and h["policy"] == DEFAULT_POLICY
        and h["model_type"] == "qwen3_moe"
    )
    prompt_tokens = h["request"]["prompt_tokens"]
    assert prompt_tokens + 12 <= trace.tokens <= prompt_tokens + 13
    assert [p.n for p in trace.passes[1:]] == [1] * (
        len(trace.passes) - 1
    )  # decode passes: one token each
    counts = trace.class_counts()
    assert counts["hit"] == after["hits"] - before["hits"] > 0
    assert (
        counts["page_cache"] + counts["ssd"] + counts["read"]
        == after["misses"] - before["misses"]
        > 0
    )
    assert sum(p.read_bytes for p in trace.passes) == after["bytes_read"] - before["bytes_read"]
    for p in trace.passes:
        assert p.ids.shape == (2, p.n, 2) and p.ids.max() < 8 and p.ms > 0
        assert [len(c) for c in p.classes] == [len(np.unique(p.ids[l])) for l in range(2)]


@pytest.mark.process
def test_trace_chunks_stream_before_done_and_resident_sends_none(tiny_model, daemon_factory):
    d = daemon_factory(tiny_model, "--cache-budget", BUDGET)
    with d.client() as c:
        events = list(c.generate("hello", max_tokens=6, raw=True, trace=True))
        untraced = list(c.generate("hello", max_tokens=6, raw=True))
    kinds = [type(e).__name__ for e in events]
    assert kinds[-1] == "DoneEvent" and "TraceEvent" in kinds
    chunks = [e for e in events if isinstance(e, TraceEvent)]
    assert [e.seq for e in chunks] == list(range(len(chunks)))
    trace = parse_trace(io.BytesIO(b"".join(e.data for e in chunks)))
    assert trace.tokens >= 6
    assert not [e for e in untraced if isinstance(e, TraceEvent)]

    r = daemon_factory(tiny_model, "--resident")
    with r.client() as c:
        events = list(c.generate("hello", max_tokens=3, raw=True, trace=True))
    assert isinstance(events[-1], DoneEvent) and not [
        e for e in events if isinstance(e, TraceEvent)
    ]


@pytest.mark.process
def test_trace_dir_records_every_generation(tiny_model, daemon_factory, tmp_path):
    folder = tmp_path / "traces"
    d = daemon_factory(tiny_model, "--cache-budget", BUDGET, "--trace-dir", str(folder))
    with d.client() as c:
        for i in range(2):
            list(c.generate(f"hello {i}", max_tokens=4, raw=True, request_id=f"req/{i}"))
    files = sorted(folder.glob("*.moetrace"))
    assert len(files) == 2 and all("req_" in f.name for f in files)
    assert [read_trace(f).header["request"]["id"] for f in files] == ["req/0", "req/1"]


def test_page_cache_and_ssd_classes_follow_the_page_cache(tiny_model):
    """In-process: after the checkpoint's pages are dropped a miss is an SSD read; once the file
    is cached again the same misses are page-cache reads."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from moed.daemon.experts import PageCachePolicy, StreamingConfig, install_streaming
    from moed.daemon.experts.store import drop_page_cache
    from moed.daemon.telemetry.residency import PageCacheProbe
    from moed.daemon.telemetry.trace import TraceRecorder, record_steps, trace_header

    def traced_run(model, streamer) -> dict:
        buf = io.BytesIO()
        rec = TraceRecorder(
            streamer, trace_header(streamer, {"name": "tiny"}, {"id": "t"}), buf.write
        )
        record_steps(rec, generate_step(mx.array([5, 6, 7, 8]), model, max_tokens=6))
        return parse_trace(io.BytesIO(buf.getvalue())).class_counts()

    results = {}
    for cached in (False, True):
        model, _ = load_model(tiny_model, lazy=True)
        streamer = install_streaming(
            model,
            tiny_model,
            StreamingConfig(cache_budget=1, memory_bytes=8 << 30, page_cache=PageCachePolicy.TRUST),
        )
        mx.eval(model.parameters())
        try:
            if cached:
                # Pull the whole file into the page cache, twice: a page read twice is on the
                # active list, which a neighbour test's streaming writes do not reclaim first.
                for _ in range(2):
                    for f in tiny_model.glob("*.safetensors"):
                        f.read_bytes()
            else:
                drop_page_cache(tiny_model.glob("*.safetensors"))
                if (
                    PageCacheProbe().resident_fraction(
                        next(tiny_model.glob("*.safetensors")), 0, 1 << 20
                    )
                    == 1.0
                ):
                    pytest.skip("this filesystem keeps the checkpoint cached (tmpfs?)")
            results[cached] = traced_run(model, streamer)
        finally:
            streamer.close()
    # Warm: page-cache reads. (A page the kernel reclaimed anyway under another test's memory
    # pressure reads as SSD, truthfully: at most a few.)
    assert results[True]["page_cache"] > 0
    assert results[True]["ssd"] <= results[True]["page_cache"] // 8, results[True]
    # Cold: the first miss of each expert goes to the device; readahead may cache neighbours.
    assert results[False]["ssd"] > 0
    assert results[False]["read"] == results[True]["read"] == 0


def test_format_is_plain_msgpack(tmp_path):
    """A reader needs only msgpack: the header and records are maps with documented keys."""
    header = {
        "format": "moed-trace",
        "version": 1,
        "layers": 1,
        "top_k": 2,
        "experts": [4],
        "id_dtype": "u1",
    }
    rec = {"n": 2, "ids": bytes([0, 1, 1, 3]), "cls": bytes([HIT, PAGE_CACHE, SSD]), "ms": 1.5}
    path = tmp_path / "x.moetrace"
    path.write_bytes(msgpack.packb(header) + msgpack.packb(rec, use_bin_type=True))
    trace = read_trace(path)
    assert trace.tokens == 2 and trace.token_rows(0).tolist() == [[0, 1], [1, 3]]
    assert trace.class_counts() == {"hit": 1, "page_cache": 1, "ssd": 1, "read": 0}
    assert CLASSES[:3] == ["hit", "page_cache", "ssd"]
    path.write_bytes(msgpack.packb({"format": "other"}))
    with pytest.raises(ValueError):
        read_trace(path)
