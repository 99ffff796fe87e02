"""A watchdog on a follower's host: the rank there binds that host's moed socket, and that host's
own watchdog guards it like a daemon. When swap keeps growing it sheds the rank's expert cache,
then makes the rank leave the group: the request in flight fails with `rank_failed` and the
service restarts the whole group.

Two "hosts" on loopback: rank 1 is started through `ssh node1` like any rank on another host. A
stand-in `ssh` (no sshd on a test machine) runs the command here, with node1's own moed socket.
Real processes throughout; the swap readings are the one scripted seam.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from moed.client import Client, RequestFailed, TokenEvent
from moed.daemon.distributed.launch import free_port_run
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.watchdog.policy import Action
from moed.daemon.watchdog.runner import Watchdog
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import short_socket_path
from tests.fixtures.watchdog import ScriptedProbe, watchdog_config

pytestmark = [pytest.mark.serial, pytest.mark.process, pytest.mark.timeout(240)]

FAKE_SSH = """#!/bin/sh
# `ssh [options] HOST COMMAND` as sshd would run it, here, with HOST's own moed socket.
for command; do :; done
MOED_SOCKET="$NODE1_SOCKET" exec sh -c "$command"
"""
PROMPT = [(31 + 7 * i) % 200 + 3 for i in range(5)]  # greedy: no end of text for 4000 tokens


def test_a_follower_hosts_watchdog_sheds_and_stops_its_rank(
    supervisor, checkpoint_factory, tmp_path
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    node1 = short_socket_path()
    hosts = tmp_path / "hosts.json"
    hosts.write_text(
        json.dumps(
            {
                "backend": "ring",
                "hosts": [
                    {"ssh": "localhost", "ips": ["127.0.0.1"]},
                    {"ssh": "node1", "ips": ["127.0.0.1"]},
                ],
            }
        )
    )
    env = {
        # node1 runs `moed rank` from its PATH, as the README asks of every host.
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "NODE1_SOCKET": str(node1),
        "MOED_PIPELINE_PORT": str(free_port_run(2)),
    }
    model = checkpoint_factory("qwen3_moe", num_layers=4)
    sup = supervisor(model, "--hostfile", str(hosts), "--cache-budget", "25%", env=env)
    first = sup.wait_ready()
    rank1 = first["ranks"][1]["pid"]
    with Client(node1) as c:  # node1's socket answers for its rank
        status = c.status()
    assert status["pid"] == rank1 and status["ranks"][0]["rank"] == 1

    # A long generation is in flight on rank 0's socket.
    outcome: dict = {}
    streaming = threading.Event()

    def generate() -> None:
        got = []
        try:
            with Client(sup.socket) as c:
                for event in c.generate(prompt_ids=PROMPT, max_tokens=4000):
                    if isinstance(event, TokenEvent):
                        got += event.ids
                        streaming.set()
        except RequestFailed as exc:
            outcome["error"] = exc
        outcome["tokens"] = len(got)

    client = threading.Thread(target=generate)
    client.start()
    assert streaming.wait(60)

    # node1's swap keeps growing: its watchdog climbs the ladder on node1's socket.
    probe = ScriptedProbe()
    signals: list = []
    dog = Watchdog(
        watchdog_config(tmp_path, node1, step_grace_s=0.2),
        probe=probe,
        send_signal=lambda pid, sig: signals.append((pid, sig)),
    )
    dog.startup()
    taken = []
    try:
        dog.tick()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(rank1):
            probe.swap_mb += 150  # fresh growth after every step
            decision = dog.tick()
            if decision.action:
                taken.append(decision.action)
            time.sleep(0.05)
    finally:
        dog.shutdown()
    client.join(60)
    assert taken == [Action.SHED_CACHE, Action.SHED_CANCEL_NEWEST, Action.SHUTDOWN]
    assert signals == []  # the rank left when asked: no signal was needed
    assert outcome["error"].code == ErrorCode.RANK_FAILED and outcome["error"].retryable
    log = sup.log_text()  # rank 1 logs to rank 0's log (its stderr)
    assert "rank 1 shed its expert cache" in log
    assert "rank 1 leaves the group: watchdog: swap grew" in log

    # The service restarts the whole group; node1's new rank answers its watchdog again.
    second = sup.wait_ready(not_boot=first["boot_id"])
    assert sup.exits == [DaemonExit.RANK_FAILED]
    assert second["ranks"][1]["pid"] != rank1
    with Client(node1) as c:
        assert c.status()["pid"] == second["ranks"][1]["pid"]
    with Client(sup.socket) as c:
        events = list(c.generate(prompt_ids=PROMPT, max_tokens=8))
    assert sum(len(e.ids) for e in events if isinstance(e, TokenEvent)) == 8


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # an exited child is a zombie until reaped
        return f.read().split(")")[-1].split()[0] != "Z"
