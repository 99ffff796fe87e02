"""`moed service install --gateway`: the HTTP gateway as a third LaunchAgent / systemd user unit,
rendered, installed, managed with the others and removed."""

from __future__ import annotations

import os
import plistlib
import shlex
from pathlib import Path

import pytest

from tests.fixtures.service_tools import (
    command_lines,
    files_under,
    heredocs,
    invoke,
    service_env,
)


@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_dry_run_renders_the_gateway_unit(tmp_path, platform):
    env = service_env(tmp_path)
    home = Path(env["HOME"])
    result = invoke(
        env, "install", "--gateway", "--gateway-port", "18080", "--dry-run", "--platform", platform
    )
    assert result.exit_code == 0, result.output
    files = heredocs(result.output)
    expected_args = ["gateway", "--socket", env["MOED_SOCKET"], "--port", "18080"]
    if platform == "macos":
        plist = home / "Library" / "LaunchAgents" / "com.moed.gateway.plist"
        job = plistlib.loads(files[str(plist)].encode())
        assert job["Label"] == "com.moed.gateway"
        assert job["ProgramArguments"][3:] == expected_args
        assert job["StandardOutPath"].endswith("/gateway.log")
        assert command_lines(result.output)[-1] == (
            f"launchctl bootstrap gui/{os.getuid()} {plist}"
        )
    else:
        unit = home / ".config" / "systemd" / "user" / "moed-gateway.service"
        text = files[str(unit)]
        exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
        assert shlex.split(exec_start.removeprefix("ExecStart="))[3:] == expected_args
        assert "After=moed.service" in text
        assert command_lines(result.output)[-1] == (
            "systemctl --user enable --now moed.service moed-watchdog.service moed-gateway.service"
        )
    assert files_under(home) == []


@pytest.mark.process
@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_an_installed_gateway_is_managed_and_removed_with_the_rest(tmp_path, fake_tools, platform):
    bin_dir, state, calls = fake_tools
    env = service_env(tmp_path, bin_dir)
    env["FAKE_STATE"] = str(state)
    home = Path(env["HOME"])
    assert invoke(env, "install", "--gateway", "--platform", platform).exit_code == 0
    names = {p.name for p in files_under(home)}
    assert names & {"com.moed.gateway.plist", "moed-gateway.service"}
    # Later verbs find the installed gateway without being told.
    stop = command_lines(invoke(env, "stop", "--dry-run", "--platform", platform).output)
    assert "gateway" in stop[0]  # stopped first (launchd), or named with the others (systemd)
    assert invoke(env, "uninstall", "--platform", platform).exit_code == 0
    assert files_under(home) == []
