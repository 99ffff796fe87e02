"""The open-file limit, as an attacker and a careless service manager would test it: a daemon
started under a low hard limit, mlx-lm's import that caps the limit at 2048, 2500 client
connections held open at once, and a config.json that is not UTF-8. Real daemons, real sockets."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest

from moed.client import Client, RequestFailed
from moed.daemon.ground.exit_codes import DaemonExit
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import serve_command, short_socket_path, start_daemon

pytestmark = pytest.mark.process

CONNECTIONS = 2500  # over mlx-lm's cap of 2048


def _limits(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _soft_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_start_under_a_hard_limit_of_1024_is_a_one_line_exit(tiny_model, tmp_path):
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1024:
        pytest.skip("this machine's hard limit is below 1024")
    cmd = serve_command(tiny_model, short_socket_path(), tmp_path / "state", "--resident")
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, preexec_fn=_limits(1024, 1024)
    )
    assert done.returncode == DaemonExit.CONFIG, done.stderr
    line = one_line(done.stderr)
    assert "open-file limit is 1024" in line and "LimitNOFILE" in line


def test_the_limit_is_raised_past_mlx_lms_cap_and_children_get_theirs_back(tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip("this machine's hard limit leaves nothing to raise")
    target = 1 << 16 if hard == resource.RLIM_INFINITY else hard
    probe = (
        "import resource, subprocess, sys\n"
        "from moed.daemon.ground.open_files import raise_open_file_limit, restore_for_child\n"
        "raise_open_file_limit()\n"
        "import mlx_lm.utils\n"  # whose import used to set (2048, 4096)
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "child = subprocess.run(['sh', '-c', 'ulimit -n'], capture_output=True, text=True,\n"
        "                       preexec_fn=restore_for_child)\n"
        "print(child.stdout.strip())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limits(256, target),
    )
    assert out.returncode == 0, out.stderr
    mine, child = out.stdout.split()
    assert int(mine) == target > 2048  # all the machine allows, not mlx-lm's 2048
    assert int(child) == 256  # what the process was started with


def _hold_connections(socket_path, count: int) -> subprocess.Popen:
    """Another process opening `count` raw connections to the daemon's socket and holding them
    (each is a descriptor in the daemon, as a ZMQ client's connection is)."""
    script = (
        "import resource, socket, sys\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))\n"
        "held = []\n"
        f"for _ in range({count}):\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        f"    s.connect({str(socket_path)!r})\n"
        "    held.append(s)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_limits(CONNECTIONS + 200, CONNECTIONS + 200),
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _connections(client: Client, at_least: int, timeout_s: float = 30.0) -> int:
    """The daemon's connection count, once its monitor has seen `at_least` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = client.status()["connections"]
        if count >= at_least or time.monotonic() > deadline:
            return count
        time.sleep(0.1)


def test_2500_client_connections_do_not_abort_the_daemon_and_past_the_limit_are_refused(
    tiny_model, tmp_path
):
    limit = CONNECTIONS - 500
    d = start_daemon(
        tmp_path,
        tiny_model,
        "--resident",
        env={"MOED_MAX_CONNECTIONS": str(limit)},
        preexec_fn=_limits(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
    )
    try:
        assert _soft_limit(d.proc.pid) > CONNECTIONS  # raised at start, kept through mlx-lm
        with Client(d.socket) as early:  # connected before the flood: keeps being served
            holder = _hold_connections(d.socket, CONNECTIONS)
            try:
                assert _connections(early, CONNECTIONS) >= CONNECTIONS
                with pytest.raises(RequestFailed) as refused:
                    Client(d.socket).connect()
                assert refused.value.code == ErrorCode.OVERLOADED and refused.value.retryable
                assert "max_connections" in str(refused.value)
                events = list(early.generate(prompt_ids=[5, 6, 7], max_tokens=4))
                assert events[-1].finish_reason in ("length", "stop")
            finally:
                holder.kill()
                holder.wait()
        assert d.proc.poll() is None, "the daemon survived"
        deadline = time.monotonic() + 30
        while True:  # the held connections close: handshakes are accepted again
            try:
                with Client(d.socket) as late:
                    assert late.status()["max_connections"] == limit
                break
            except RequestFailed:
                assert time.monotonic() < deadline, "the count never fell"
                time.sleep(0.2)
    finally:
        d.stop()


def test_a_config_json_that_is_not_utf8_is_a_one_line_exit_naming_it(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "config.json").write_bytes(b'{"model_type": "qwen3_moe", "name": "\xff\xfe"}')
    cmd = serve_command(model, short_socket_path(), tmp_path / "state", "--resident")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == DaemonExit.MODEL_UNUSABLE, done.stderr
    line = one_line(done.stderr)
    assert str(model / "config.json") in line and "not UTF-8" in line
