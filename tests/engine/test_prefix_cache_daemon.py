"""The prefix cache through real daemons: `cached_tokens` in `done`, `moe cache list|clear`,
`moe stats` and the metrics, the next turn after a restart read from the SSD, and a resume after a
crash that does not read its prompt again; tokens always those of a daemon with the cache off."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from moed.client import DoneEvent, RequestFailed, TokenEvent
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import moe

pytestmark = pytest.mark.process

SYSTEM = [(11 * i) % 220 + 3 for i in range(48)]
TURNS = [SYSTEM + [5, 6], SYSTEM + [5, 6, 7, 8, 9], SYSTEM + [5, 6, 7, 8, 9, 10, 12]]


def turn(daemon, ids: list[int], **fields) -> tuple[list[int], dict]:
    tokens, done = [], None
    with daemon.client(timeout=60) as c:
        for e in c.generate(prompt_ids=ids, max_tokens=6, **fields):
            if isinstance(e, TokenEvent):
                tokens += e.ids
            elif isinstance(e, DoneEvent):
                done = e
    return tokens, done.usage


def wait_for(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def entries_on_disk(daemon) -> int:
    with daemon.client() as c:
        return c.prefix_cache()["stats"]["disk_entries"]


def entries_listed(daemon) -> list:
    with daemon.client() as c:
        return c.prefix_cache()["entries"]


def test_turns_hit_the_cache_across_a_restart_and_the_cache_lists_and_clears(
    daemon_factory, tiny_model, tmp_path_factory
):
    off = daemon_factory(tiny_model, "--prefix-cache", "0")
    expected = [turn(off, ids)[0] for ids in TURNS]
    off.stop()
    shared = ("--prefix-cache-dir", str(tmp_path_factory.mktemp("prefix-cache")))
    first = daemon_factory(tiny_model, *shared)
    got, usage = zip(*(turn(first, ids) for ids in TURNS[:2]))
    assert usage[0]["cached_tokens"] == 0 and usage[1]["cached_tokens"] >= len(TURNS[0])
    listed = json.loads(moe(first.socket, "cache", "list", "--json").stdout)
    assert listed["enabled"] and listed["entries"] and "memory" in listed["entries"][0]["tiers"]
    stats = json.loads(moe(first.socket, "stats", "--json").stdout)["prefix_cache"]
    assert stats["hits"] == 1 and stats["tokens_reused"] == usage[1]["cached_tokens"]
    assert "prefix cache 1 hits of 2" in moe(first.socket, "stats").stdout
    metrics = moe(first.socket, "metrics").stdout
    assert "moed_prefix_cache_hits_total 1" in metrics
    assert 'moed_prefix_cache_bytes{tier="disk"}' in metrics
    wait_for(lambda: entries_on_disk(first) > 0)
    assert first.stop() == 0

    second = daemon_factory(tiny_model, *shared)  # a new process: only the SSD tier remains
    tokens, usage3 = turn(second, TURNS[2])
    assert list(got) + [tokens] == expected
    assert usage3["cached_tokens"] >= len(TURNS[1]), usage3
    with second.client() as c:
        assert c.prefix_cache()["stats"]["disk_loads"] == 1
        # clear needs the owner's token: a bare frame without it is refused
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"ipc://{second.socket}")
        sock.send(msgpack.packb({"v": 1, "type": "prefix_cache", "id": 1, "action": "clear"}))
        assert sock.poll(10_000)
        refused = msgpack.unpackb(sock.recv())
        sock.close(0)
        assert refused["type"] == "error" and refused["code"] == ErrorCode.NOT_PERMITTED.value
    cleared = moe(second.socket, "cache", "clear")
    assert cleared.returncode == 0, cleared.stderr
    wait_for(lambda: not entries_listed(second))
    assert not list(Path(shared[1]).glob("*.safetensors"))
    assert turn(second, TURNS[2]) == (expected[2], {**usage3, "cached_tokens": 0})


def test_a_resume_after_a_crash_reads_its_context_from_the_ssd(
    daemon_factory, tiny_model, tmp_path_factory
):
    prompt = SYSTEM + [40, 41, 42]
    clean = daemon_factory(tiny_model, "--prefix-cache", "0")
    with clean.client(timeout=60) as c:
        want = [
            t
            for e in c.generate(prompt_ids=prompt, max_tokens=24)
            if isinstance(e, TokenEvent)
            for t in e.ids
        ]
    clean.stop()
    shared = ("--prefix-cache-dir", str(tmp_path_factory.mktemp("prefix-cache")))
    crashing = daemon_factory(tiny_model, *shared, env={"MOED_DEBUG_FAULTS": "oom_after=12"})
    partial = []
    try:
        with crashing.client(timeout=60) as c:
            for e in c.generate(prompt_ids=prompt, max_tokens=24):
                if isinstance(e, TokenEvent):
                    partial += e.ids
    except RequestFailed as err:
        assert err.code is ErrorCode.OUT_OF_MEMORY
    assert crashing.proc.wait(30) != 0 and 0 < len(partial) < len(want)
    again = daemon_factory(tiny_model, *shared)
    rest, done = [], None
    with again.client(timeout=60) as c:
        for e in c.generate(prompt_ids=prompt, max_tokens=24, resume_ids=partial):
            if isinstance(e, TokenEvent):
                rest += e.ids
            elif isinstance(e, DoneEvent):
                done = e
    assert partial + rest == want
    # The prompt was read before the crash and kept on the SSD: not read again.
    assert done.usage["cached_tokens"] >= len(prompt) - 1, done.usage
