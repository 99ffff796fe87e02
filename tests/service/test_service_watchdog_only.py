"""`moed service install --watchdog-only`: a pipeline's other host runs only the watchdog (it
guards the rank that binds that host's socket), managed and removed like a full install."""

from __future__ import annotations

import os
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
def test_dry_run_renders_only_the_watchdog(tmp_path, platform):
    env = service_env(tmp_path)
    home = Path(env["HOME"])
    result = invoke(env, "install", "--watchdog-only", "--dry-run", "--platform", platform)
    assert result.exit_code == 0, result.output
    units = [Path(p).name for p in heredocs(result.output) if not p.endswith("config.toml")]
    if platform == "macos":
        assert units == ["com.moed.watchdog.plist"]
        plist = home / "Library" / "LaunchAgents" / "com.moed.watchdog.plist"
        assert command_lines(result.output)[-1] == (
            f"launchctl bootstrap gui/{os.getuid()} {plist}"
        )
    else:
        assert units == ["moed-watchdog.service"]
        assert command_lines(result.output)[-1] == (
            "systemctl --user enable --now moed-watchdog.service"
        )
    assert files_under(home) == []


def test_watchdog_only_takes_no_serve_options(tmp_path):
    env = service_env(tmp_path)
    result = invoke(env, "install", "--watchdog-only", "--model", "/m", "--dry-run")
    assert result.exit_code == 2 and "takes no serve options" in result.output


@pytest.mark.process
@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_an_installed_watchdog_alone_is_managed_and_removed(tmp_path, fake_tools, platform):
    bin_dir, state, calls = fake_tools
    env = service_env(tmp_path, bin_dir)
    env["FAKE_STATE"] = str(state)
    home = Path(env["HOME"])
    assert invoke(env, "install", "--watchdog-only", "--platform", platform).exit_code == 0
    names = {p.name for p in files_under(home)}
    assert names & {"com.moed.watchdog.plist", "moed-watchdog.service"}
    assert not names & {"com.moed.daemon.plist", "moed.service"}
    # Later verbs find the watchdog alone without being told: no daemon to start or stop.
    for verb in ("start", "stop", "restart"):
        lines = command_lines(invoke(env, verb, "--dry-run", "--platform", platform).output)
        assert lines and all("watchdog" in line for line in lines), lines
    logs = command_lines(invoke(env, "logs", "--dry-run", "--platform", platform).output)
    assert logs and not any("daemon.log" in line for line in logs), logs
    assert invoke(env, "uninstall", "--platform", platform).exit_code == 0
    assert files_under(home) == []
