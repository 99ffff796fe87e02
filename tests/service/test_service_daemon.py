"""The daemon started exactly as the service manager would start it serves a request.

`moed service install` writes the config and the unit (systemd) or plist (launchd) into a temporary
HOME (the service manager itself is a recording stand-in); the test then runs the unit's ExecStart /
the plist's ProgramArguments with only the environment the unit gives, as systemd or launchd would,
sends a generation with the real client, and stops it with SIGTERM: a clean exit (0), which neither
Restart=on-failure nor KeepAlive {SuccessfulExit: false} would restart.
"""

from __future__ import annotations

import plistlib
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moed.client import Client, DoneEvent, TokenEvent
from moed.client.autostart import wait_until_ready
from tests.fixtures.service_tools import invoke, service_env

pytestmark = pytest.mark.process


def unit_command(text: str) -> tuple[list[str], dict[str, str]]:
    argv, env = None, {}
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            argv = [
                w.replace("%%", "%").replace("$$", "$")
                for w in shlex.split(line[len("ExecStart=") :])
            ]
        elif line.startswith("Environment="):
            for word in shlex.split(line[len("Environment=") :]):
                key, value = word.replace("%%", "%").split("=", 1)
                env[key] = value
    assert argv is not None
    return argv, env


@pytest.mark.parametrize("platform", ["linux", "macos"])
def test_daemon_started_from_the_rendered_unit_serves(tmp_path, fake_tools, tiny_model, platform):
    bin_dir, state, _ = fake_tools
    env = service_env(tmp_path, bin_dir)
    env.update(FAKE_STATE=str(state), MOED_RESIDENT="1")
    home = Path(env["HOME"])
    socket = Path(env["MOED_SOCKET"])
    result = invoke(env, "install", "--platform", platform, "--model", str(tiny_model))
    assert result.exit_code == 0, result.output

    if platform == "linux":
        argv, unit_env = unit_command(
            (home / ".config" / "systemd" / "user" / "moed.service").read_text()
        )
        output = tmp_path / "journal.log"  # systemd would send stdout/stderr to the journal
    else:
        job = plistlib.loads(
            (home / "Library" / "LaunchAgents" / "com.moed.daemon.plist").read_bytes()
        )
        argv, unit_env = job["ProgramArguments"], job["EnvironmentVariables"]
        output = Path(job["StandardOutPath"])  # launchd opens it; install made its directory
        assert job["StandardErrorPath"] == str(output) and output.parent.is_dir()
    assert argv[0] == sys.executable

    # Only what the service manager provides: no MOED_* from the test's environment.
    run_env = {"HOME": str(home), "PATH": "/usr/bin:/bin", **unit_env}
    with open(output, "ab") as out:
        proc = subprocess.Popen(
            argv,
            env=run_env,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )
    try:
        status = wait_until_ready(socket, proc, 120.0, output)
        assert status.get("state") == "ready"
        ids, done = [], None
        with Client(socket, timeout=30.0) as c:
            for event in c.generate("def fibonacci(n):", max_tokens=8, raw=True):
                if isinstance(event, TokenEvent):
                    ids += event.ids
                elif isinstance(event, DoneEvent):
                    done = event
        assert done is not None and len(ids) == done.usage["completion_tokens"] > 0

        # `moed service status` finds the daemon through the installed config and shows its answer.
        result = invoke(env, "status", "--platform", platform)
        assert f"daemon answers on {socket}" in result.output, result.output
        assert "state     ready" in result.output and "{'" not in result.output  # no raw dicts

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, output.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for leftover in (socket,):
            leftover.unlink(missing_ok=True)
        try:
            socket.parent.rmdir()
        except OSError:
            pass
