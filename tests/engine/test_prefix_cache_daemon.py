"""The prefix cache through real daemons: `cached_tokens` in `done`, `moe cache list|clear`,
`moe stats` and the metrics, the next turn after a restart read from the SSD, and a resume after a
crash that does not read its prompt again; tokens always those of a daemon with the cache off. A
FIFO in the SSD tier's folder does not hang the start; a folder others can write is refused."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from moed.client import DoneEvent, RequestFailed, TokenEvent
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import moe, serve_command, short_socket_path

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
    name = json.loads(moe(first.socket, "stats", "--json").stdout)["models"][0]["name"]
    assert f'moed_prefix_cache_hits_total{{model="{name}"}} 1' in metrics
    assert f'moed_prefix_cache_bytes{{model="{name}",tier="disk"}}' in metrics
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


def test_a_fifo_in_the_folder_neither_hangs_the_start_nor_stops_serving(
    daemon_factory, tiny_model, tmp_path_factory
):
    folder = tmp_path_factory.mktemp("prefix-cache")
    fifo = folder / ("ee" * 16 + ".safetensors")
    os.mkfifo(fifo)
    # Once, the load opened the FIFO for reading and waited for a writer forever ("loading").
    daemon = daemon_factory(tiny_model, "--prefix-cache-dir", str(folder), wait=False)
    daemon.wait_ready(timeout_s=60)
    tokens, usage = turn(daemon, TURNS[0])
    assert tokens and usage["cached_tokens"] == 0
    with daemon.client() as c:
        stats = c.prefix_cache()["stats"]
    assert stats["disk_rejected"] == {"not_regular": 1}, stats
    assert "disk skipped 1" in moe(daemon.socket, "stats").stdout
    with pytest.raises(OSError) as nobody:  # nobody holds it open for reading
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    assert nobody.value.errno == errno.ENXIO


def _serve_refused(model, folder: Path, tmp_path: Path) -> str:
    """`moed serve` on `folder`: it must exit 2 with one line, touching nothing; that line."""
    mode = folder.stat().st_mode
    out = subprocess.run(
        serve_command(model, short_socket_path(), tmp_path / "state", "--resident")
        + ["--prefix-cache-dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MOED_LOG_DIR": str(tmp_path / "logs")},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if "moed:" in line]
    assert len(lines) == 1 and str(folder) in lines[0], out.stderr
    assert folder.stat().st_mode == mode and not list(folder.iterdir())  # nothing chmodded
    return lines[0]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_folder_others_can_write_is_refused_at_start(tiny_model, tmp_path, mode):
    folder = tmp_path / "shared-cache"
    folder.mkdir()
    folder.chmod(mode)
    line = _serve_refused(tiny_model, folder, tmp_path)
    assert f"{mode:04o}" in line and "others can write" in line


def test_another_users_folder_is_refused_at_start(other_user, tiny_model, tmp_path):
    folder = tmp_path / "their-cache"
    folder.mkdir(mode=0o700)
    os.chown(folder, other_user.pw_uid, other_user.pw_gid)
    line = _serve_refused(tiny_model, folder, tmp_path)
    assert f"uid {other_user.pw_uid}" in line
