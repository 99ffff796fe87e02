"""Pipeline ranks accept only their own group: another local user hammering the published port
while the group starts, connections that speak garbage, stay silent or guess the secret, and a
rank that fails again and again; written as the attack, with real processes and sockets."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from moed.client import Client, DoneEvent, RequestFailed, TokenEvent
from moed.daemon.distributed.guard import GuardRefused, Rendezvous, join, new_secret
from moed.daemon.distributed.hostfile import LOOPBACK, RankHost
from moed.daemon.distributed.launch import free_port_run
from moed.daemon.distributed.ring_links import LinkListeners, RingLinks, form_links
from moed.daemon.ground import crashlog
from moed.daemon.ground.exit_codes import DaemonExit
from moed.protocol import ErrorCode
from tests.fixtures.pipeline_requests import PROMPT_IDS, tokens
from tests.fixtures.reference import generate

pytestmark = pytest.mark.timeout(240)

# Another user's process: connect to each port, send junk or nothing, hold, close; forever.
STRAY = """
import socket, sys, time, random
ports = [int(p) for p in sys.argv[1:]]
held = []
while True:
    for port in ports:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            continue
        if random.random() < 0.5:
            try:
                s.sendall(bytes(random.getrandbits(8) for _ in range(64)))
            except OSError:
                pass
        held.append(s)
    if len(held) > 20:
        for s in held[:10]:
            s.close()
        del held[:10]
    time.sleep(0.05)
"""


def _hosts(n: int) -> tuple[RankHost, ...]:
    return tuple(RankHost(r, LOOPBACK, (LOOPBACK,)) for r in range(n))


def test_the_guard_drops_strays_and_hands_the_ring_only_to_the_group():
    hosts = _hosts(3)
    secret = new_secret()
    port = free_port_run(1)
    ports = [LinkListeners(h.ips) for h in hosts]
    guard = Rendezvous(hosts, (LOOPBACK, port), secret, ports[0].addresses)
    try:
        silent = socket.create_connection((LOOPBACK, port))  # says nothing: dropped in seconds
        junk = socket.create_connection((LOOPBACK, port))
        junk.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
        with pytest.raises(GuardRefused):  # knows the protocol, not the secret
            join((LOOPBACK, port), 1, ports[1].addresses, new_secret(), connect_s=5)
        results: dict[int, list] = {}
        threads = [
            threading.Thread(
                target=lambda r=r: results.setdefault(
                    r, join((LOOPBACK, port), r, ports[r].addresses, secret)
                )
            )
            for r in (1, 2)
        ]
        for t in threads:
            t.start()
        ring = guard.wait(lambda: None)
        for t in threads:
            t.join(30)
        assert results[1] == results[2] == ring == [p.addresses for p in ports]
        assert guard.dropped >= 2  # the junk and the wrong secret at least; the silent one soon
        silent.close()
        junk.close()
        # The guard is closed once the group has formed: nothing listens on the published port.
        with pytest.raises(OSError):
            socket.create_connection((LOOPBACK, port), timeout=2)
    finally:
        guard.close()
        for listeners in ports:
            listeners.close()


def test_ring_links_are_proved_and_strangers_on_the_ring_ports_are_dropped():
    """Three ranks link up in a ring while strangers sit on every ring port (silent, junk, the
    right protocol with a wrong secret, another rank's place): each link carries bytes from a
    rank to its right neighbour, and only the group's own connections became links."""
    hosts = _hosts(3)
    secret = new_secret()
    ports = [LinkListeners(h.ips) for h in hosts]
    ring = [p.addresses for p in ports]
    strangers = []
    for [address] in ring:
        host, port = address.rsplit(":", 1)
        strangers.append(socket.create_connection((host, int(port))))  # silent
        junk = socket.create_connection((host, int(port)))
        junk.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
        strangers.append(junk)
    with pytest.raises(GuardRefused):  # the protocol without the secret
        form_links(1, ring, LinkListeners([LOOPBACK]), new_secret(), timeout_s=3)
    links: dict[int, RingLinks] = {}
    threads = [
        threading.Thread(
            target=lambda r=r: links.setdefault(r, form_links(r, ring, ports[r], secret))
        )
        for r in range(3)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(links) == [0, 1, 2]
        for r in range(3):
            links[r].right[0].sendall(f"from {r}".encode())
        for r in range(3):
            assert links[r].left[0].recv(16) == f"from {(r - 1) % 3}".encode()
        # The ring's ports closed once linked: a stranger finds nothing there now.
        with pytest.raises(OSError):
            host, port = ring[0][0].rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=2)
    finally:
        for got in links.values():
            got.close()
        for stranger in strangers:
            stranger.close()


def test_a_rank_must_name_the_addresses_its_hostfile_gives():
    hosts = _hosts(2)
    secret = new_secret()
    port = free_port_run(1)
    guard = Rendezvous(hosts, (LOOPBACK, port), secret, [f"{LOOPBACK}:1"])
    try:
        with pytest.raises(GuardRefused):
            join((LOOPBACK, port), 1, ["127.0.0.2:5000"], secret, connect_s=5)
        assert guard.dropped == 1
    finally:
        guard.close()


@pytest.mark.process
def test_another_user_on_the_ports_while_the_group_starts_does_not_fail_it(
    other_user,
    supervisor,
    checkpoint_factory,
):
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3 the second user can run")
    port = free_port_run(4)
    stray = subprocess.Popen(
        [python, "-c", STRAY, *(str(port + i) for i in range(4))],
        user=other_user.pw_uid,
        group=other_user.pw_gid,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)  # it is already knocking when the group starts
        assert stray.poll() is None
        path = checkpoint_factory("qwen3_moe", num_layers=4)
        sup = supervisor(
            path, "--pipeline", "2", "--cache-budget", "25%", env={"MOED_PIPELINE_PORT": str(port)}
        )
        sup.wait_ready()
        with Client(sup.socket) as c:
            assert len(tokens(c, 8)) == 8
        assert sup.exits == [], "the group formed at the first try"
        assert "pipeline guard: dropped a connection" in sup.log_text()
    finally:
        stray.kill()
        stray.wait()


def test_rank_failures_never_make_a_request_poison_or_spend_the_restart_budget(tmp_path):
    """The crash record of a daemon whose rank was killed six times with the same request in
    flight: the next start replays the request and is not refused."""
    request = {"type": "generate", "prompt_ids": PROMPT_IDS, "max_tokens": 64}
    fp = crashlog.fingerprint(request)
    for i in range(6):
        boot = f"boot{i}"
        crashlog.begin_run(tmp_path, boot)
        crashlog.write_inflight(tmp_path, boot, [fp])
        crashlog.record_crash(tmp_path, crashlog.CrashKind.RANK_FAILED, "rank 1 exited", boot)
    plan = crashlog.plan_start(tmp_path, restart_budget=5, window_s=600)
    assert fp not in plan.poison and plan.refuse is None and plan.budget_factor == 1.0
    recorded = json.loads((tmp_path / crashlog.CRASH_FILE).read_text())
    assert [e["kind"] for e in recorded["history"]] == ["rank_failed"] * 6  # still on record
    # The daemon's own crashes still count: two with the request in flight make it poison.
    for i in range(2):
        boot = f"own{i}"
        crashlog.begin_run(tmp_path, boot)
        crashlog.write_inflight(tmp_path, boot, [fp])
        crashlog.record_crash(tmp_path, crashlog.CrashKind.ENGINE_FAILED, "engine died", boot)
    assert fp in crashlog.plan_start(tmp_path, restart_budget=5, window_s=600).poison


@pytest.mark.process
def test_the_rank_environment_carries_no_spec_or_secret(supervisor, checkpoint_factory):
    """MOED_RANK_SPEC is gone: what rank 0 decided reaches a follower as an argument, the secret
    on its stdin; neither is in any rank's environment."""
    path = checkpoint_factory("qwen3_moe", num_layers=4)
    sup = supervisor(path, "--pipeline", "2", "--cache-budget", "25%")
    ready = sup.wait_ready()
    with Client(sup.socket) as c:
        assert len(tokens(c, 4)) == 4
    for rank in ready["ranks"]:
        with open(f"/proc/{rank['pid']}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        assert b"MOED_RANK_SPEC" not in env
        assert not any(b"secret" in k.lower() for k in env)
    assert os.environ.get("MOED_RANK_SPEC") is None


@pytest.mark.process
def test_a_rank_killed_twice_leaves_the_request_retryable_and_the_budget_whole(
    supervisor, checkpoint_factory
):
    """Kill the follower twice while the same request runs, under a restart budget of 2: the third
    try of that request is served (not `poison_request`), and the daemon is not left down."""
    path = checkpoint_factory("qwen3_moe", num_layers=4)
    sup = supervisor(
        path,
        "--pipeline",
        "2",
        "--cache-budget",
        "25%",
        env={"MOED_RESTART_BUDGET": "2", "MOED_RANK_TIMEOUT_S": "1"},
    )
    boot = None
    for _ in range(2):
        ready = sup.wait_ready(not_boot=boot)
        boot, follower = ready["boot_id"], ready["ranks"][1]["pid"]
        with Client(sup.socket) as c:
            with pytest.raises(RequestFailed) as err:
                for event in c.generate(prompt_ids=PROMPT_IDS, max_tokens=400):
                    if isinstance(event, TokenEvent) and event.index == 10:
                        os.kill(follower, signal.SIGKILL)
        assert err.value.code == ErrorCode.RANK_FAILED and err.value.retryable
    sup.wait_ready(not_boot=boot)
    with Client(sup.socket) as c:
        done = list(c.generate(prompt_ids=PROMPT_IDS, max_tokens=400))
    assert isinstance(done[-1], DoneEvent), done[-1]
    assert sup.exits == [DaemonExit.RANK_FAILED] * 2


# Another user's process that watches for new listening loopback ports (as `ss -tln` shows anyone
# the ring's ports) and connects to each the moment it appears, holding every connection.
SCANNER = """
import socket, time
def listening():
    ports = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            local, state = line.split()[1:4:2]
            if state == "0A" and local.startswith("0100007F:"):
                ports.add(int(local.split(":")[1], 16))
    return ports
seen = listening()
held = []
while True:
    now = listening()
    for port in now - seen:
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            print(port, flush=True)
        except OSError:
            pass
    seen = now
    time.sleep(0.0005)
"""


@pytest.mark.process
def test_a_stranger_on_the_ring_ports_as_they_open_costs_the_group_nothing(
    other_user, supervisor, checkpoint_factory, tmp_path
):
    """Another local user connects to every loopback port the moment it starts listening (the
    ring's own ports too) while the group forms: the group starts at the first try and its
    tokens are the resident model's."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3 the second user can run")
    path = checkpoint_factory("qwen3_moe", num_layers=4)
    expected = generate(path, PROMPT_IDS, 12)
    knocked = tmp_path / "knocked"  # the ports it got a connection to, one a line
    with open(knocked, "w") as out:
        scanner = subprocess.Popen(
            [python, "-c", SCANNER],
            user=other_user.pw_uid,
            group=other_user.pw_gid,
            stdout=out,
            stderr=subprocess.DEVNULL,
        )
    try:
        time.sleep(0.5)
        assert scanner.poll() is None
        before = 0
        for attempt in range(3):  # three group starts, each with the stranger at every port
            sup = supervisor(path, "--pipeline", "2", "--cache-budget", "25%")
            sup.wait_ready()
            with Client(sup.socket) as c:
                assert tokens(c, 12) == expected, attempt
            assert sup.exits == [], "the group formed at the first try"
            sup.stop()
            # It was there: connected at the guard, the ring's ports and MLX's stand-ins.
            now = len(knocked.read_text().split())
            assert now - before >= 3, (attempt, now - before)
            before = now
    finally:
        scanner.kill()
        scanner.wait()
