"""`moed service ...` end to end in a temporary HOME: dry runs, and install → status → uninstall.

The real launchctl/systemctl are replaced by a recording stand-in on PATH that keeps which jobs are
loaded and answers `print`/`show` like the real tools (launchctl from recorded Mac output).
"""

from __future__ import annotations

import json
import os
import plistlib
import re
import sys
from pathlib import Path

import pytest

from tests.fixtures.service_tools import command_lines, files_under, heredocs, invoke, service_env

UID = os.getuid()
DATA = Path(__file__).parents[1] / "data"


# --- dry runs: the exact command lines, for both platforms, and nothing written ------------------


def _mac(home: Path):
    agents = home / "Library" / "LaunchAgents"
    logs = home / "Library" / "Logs" / "moed"
    d, w = f"gui/{UID}/com.moed.daemon", f"gui/{UID}/com.moed.watchdog"
    return {
        "install": [
            f"launchctl bootout {d} || true",
            f"launchctl enable {d} || true",
            f"launchctl bootstrap gui/{UID} {agents}/com.moed.daemon.plist",
            f"launchctl bootout {w} || true",
            f"launchctl enable {w} || true",
            f"launchctl bootstrap gui/{UID} {agents}/com.moed.watchdog.plist",
        ],
        "uninstall": [f"launchctl bootout {w} || true", f"launchctl bootout {d} || true"],
        "start": [
            f"launchctl bootstrap gui/{UID} {agents}/com.moed.daemon.plist || true",
            f"launchctl kickstart {d}",
            f"launchctl bootstrap gui/{UID} {agents}/com.moed.watchdog.plist || true",
            f"launchctl kickstart {w}",
        ],
        "stop": [f"launchctl bootout {w} || true", f"launchctl bootout {d} || true"],
        "restart": [f"launchctl kickstart -k {d}", f"launchctl kickstart -k {w}"],
        "status": [f"launchctl print {d}", f"launchctl print {w}"],
        "logs": [f"tail -n 200 {logs}/daemon.log {logs}/watchdog.log"],
        "logs -f": [f"tail -n 200 -F {logs}/daemon.log {logs}/watchdog.log"],
    }


def _linux(home: Path):
    units = "moed.service moed-watchdog.service"
    daemon_log = home / ".local" / "state" / "moed" / "logs" / "daemon.log"
    return {
        "install": ["systemctl --user daemon-reload", f"systemctl --user enable --now {units}"],
        "uninstall": [
            f"systemctl --user disable --now {units} || true",
            "systemctl --user daemon-reload || true",
            f"systemctl --user reset-failed {units} || true",
        ],
        "start": [f"systemctl --user start {units}"],
        "stop": [f"systemctl --user stop {units}"],
        "restart": [f"systemctl --user restart {units}"],
        "status": [
            "systemctl --user show -p LoadState,ActiveState,SubState,UnitFileState,MainPID,"
            "ExecMainCode,ExecMainStatus,Result,NRestarts moed.service",
            "systemctl --user show -p LoadState,ActiveState,SubState,UnitFileState,MainPID,"
            "ExecMainCode,ExecMainStatus,Result,NRestarts moed-watchdog.service",
        ],
        # daemon.log has the daemon's whole story; the watchdog logs to the journal.
        "logs": [
            f"tail -n 200 {daemon_log}",
            "journalctl --user -u moed-watchdog.service -n 200 --no-pager",
        ],
        "logs -f": [
            f"tail -n 200 -F {daemon_log}",
            "journalctl --user -u moed-watchdog.service -n 200 --no-pager -f",
        ],
    }


EXPECTED = {"macos": _mac, "linux": _linux}
VERBS = ["install", "uninstall", "start", "stop", "restart", "status", "logs", "logs -f"]


@pytest.mark.parametrize("platform", ["macos", "linux"])
@pytest.mark.parametrize("verb", VERBS)
def test_dry_run_prints_exact_commands(tmp_path, platform, verb):
    env = service_env(tmp_path)
    home = Path(env["HOME"])
    result = invoke(env, *verb.split(), "--dry-run", "--platform", platform)
    assert result.exit_code == 0, result.output
    assert command_lines(result.output) == EXPECTED[platform](home)[verb]
    # A dry run writes nothing at all.
    assert files_under(home) == []


@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_dry_run_install_prints_every_file(tmp_path, platform):
    env = service_env(tmp_path)
    home = Path(env["HOME"])
    result = invoke(
        env,
        "install",
        "--dry-run",
        "--platform",
        platform,
        "--model",
        "/models/tiny",
        "--cache-budget",
        "2GB",
    )
    files = heredocs(result.output)
    if platform == "macos":
        config = home / "Library" / "Application Support" / "moed" / "config.toml"
        units = [
            home / "Library" / "LaunchAgents" / f"com.moed.{r}.plist"
            for r in ("daemon", "watchdog")
        ]
        for unit in units:
            assert plistlib.loads(files[str(unit)].encode())["Label"] == unit.stem
        assert f"mkdir -p {home}/Library/Logs/moed" in result.output.splitlines()
    else:
        config = home / ".config" / "moed" / "config.toml"
        units = [
            home / ".config" / "systemd" / "user" / n
            for n in ("moed.service", "moed-watchdog.service")
        ]
        for unit in units:
            assert "ExecStart=" + sys.executable in files[str(unit)]
    assert set(files) == {str(config), *map(str, units)}
    import tomllib

    settings = tomllib.loads(files[str(config)])
    assert (
        settings["serve"]["model"] == "/models/tiny" and settings["serve"]["cache_budget"] == "2GB"
    )
    assert settings["serve"]["socket"] == env["MOED_SOCKET"]


# --- install → status → uninstall with a recording stand-in for launchctl/systemctl ---------------


@pytest.mark.process
@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_install_status_uninstall_leaves_nothing(tmp_path, fake_tools, platform):
    bin_dir, state, calls = fake_tools
    env = service_env(tmp_path, bin_dir)
    env["FAKE_STATE"] = str(state)
    env["FAKE_PRINT"] = str(DATA / "launchctl_print_running.txt")
    home = Path(env["HOME"])

    result = invoke(env, "install", "--platform", platform)
    assert result.exit_code == 0, result.output
    installed = files_under(home)
    if platform == "macos":
        assert {p.name for p in installed} == {
            "com.moed.daemon.plist",
            "com.moed.watchdog.plist",
            "config.toml",
        }
        assert (home / "Library" / "Logs" / "moed").is_dir()
        assert [c[1] for c in calls() if c[0] == "launchctl"] == [
            "bootout",
            "enable",
            "bootstrap",
        ] * 2
    else:
        assert {p.name for p in installed} == {
            "moed.service",
            "moed-watchdog.service",
            "config.toml",
        }
        assert calls()[-1] == [
            "systemctl",
            "--user",
            "enable",
            "--now",
            "moed.service",
            "moed-watchdog.service",
        ]

    # A second install keeps the config and replaces the loaded jobs without error.
    config = next(p for p in installed if p.name == "config.toml")
    before = config.read_text()
    assert invoke(env, "install", "--platform", platform).exit_code == 0
    assert config.read_text() == before

    result = invoke(env, "status", "--platform", platform)
    # Loaded and running per the service manager; the daemon itself does not answer: exit 3.
    assert result.exit_code == 3, result.output
    pid = "4127" if platform == "macos" else "812"
    assert re.search(rf"^daemon .*: loaded, running, pid {pid}", result.output, flags=re.M), (
        result.output
    )
    assert re.search(rf"^watchdog .*: loaded, running, pid {pid}", result.output, flags=re.M), (
        result.output
    )
    assert "daemon does not answer on " + env["MOED_SOCKET"] in result.output

    report = json.loads(invoke(env, "status", "--platform", platform, "--json").output)
    assert [s["running"] for s in report["services"]] == [True, True]
    assert report["daemon"] is None

    result = invoke(env, "uninstall", "--platform", platform)
    assert result.exit_code == 0, result.output
    assert files_under(home) == []
    assert not (home / "Library" / "Logs" / "moed").exists()
    assert not (home / ".config" / "moed").exists()

    result = invoke(env, "status", "--platform", platform)
    assert result.exit_code == 3
    assert "not loaded (not installed)" in result.output


@pytest.mark.process
def test_uninstall_keeps_an_edited_config_unless_purged(tmp_path, fake_tools):
    bin_dir, state, _ = fake_tools
    env = service_env(tmp_path, bin_dir)
    env["FAKE_STATE"] = str(state)
    home = Path(env["HOME"])
    assert invoke(env, "install", "--platform", "linux").exit_code == 0
    config = home / ".config" / "moed" / "config.toml"
    config.write_text(config.read_text().replace('cache_budget = "auto"', 'cache_budget = "3GB"'))
    log_dir = home / ".local" / "state" / "moed" / "logs"
    (log_dir / "daemon.log").write_text("a line\n")

    result = invoke(env, "uninstall", "--platform", "linux")
    assert result.exit_code == 0
    assert files_under(home) == sorted([config, log_dir / "daemon.log"])
    assert "kept your config" in result.output and "kept the logs" in result.output

    assert invoke(env, "uninstall", "--platform", "linux", "--purge").exit_code == 0
    assert files_under(home) == []


@pytest.mark.process
def test_install_keeps_an_existing_config(tmp_path, fake_tools):
    bin_dir, state, _ = fake_tools
    env = service_env(tmp_path, bin_dir)
    env["FAKE_STATE"] = str(state)
    config = Path(env["HOME"]) / ".config" / "moed" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('[serve]\nmodel = "mine"\n')
    result = invoke(env, "install", "--platform", "linux", "--model", "other")
    assert result.exit_code == 0
    assert config.read_text() == '[serve]\nmodel = "mine"\n'
    assert "is kept" in result.output


@pytest.mark.process
def test_restart_when_not_loaded_says_what_to_do(tmp_path, fake_tools):
    bin_dir, state, _ = fake_tools
    env = service_env(tmp_path, bin_dir)
    env["FAKE_STATE"] = str(state)
    result = invoke(env, "restart", "--platform", "macos")
    assert result.exit_code == 1
    assert "moed service start" in result.output


@pytest.mark.process
def test_status_reports_a_crash(tmp_path, fake_tools):
    bin_dir, state, _ = fake_tools
    env = service_env(tmp_path, bin_dir)
    env.update(
        FAKE_STATE=str(state), FAKE_PRINT=str(DATA / "launchctl_print_restarted_after_crash.txt")
    )
    assert invoke(env, "install", "--platform", "macos").exit_code == 0
    result = invoke(env, "status", "--platform", "macos")
    assert "loaded, running, pid 5230, runs 3, last exit: killed by Abort trap: 6" in result.output


@pytest.mark.process
def test_logs_runs_the_viewer(tmp_path, fake_tools):
    bin_dir, state, calls = fake_tools
    env = service_env(tmp_path, bin_dir)
    env["FAKE_STATE"] = str(state)
    assert invoke(env, "logs", "--platform", "linux", "-f", "-n", "5").exit_code == 0
    # Both followers run at once: daemon.log and the watchdog's journal.
    seen = sorted(calls()[-2:])
    assert seen[0][:4] == ["journalctl", "--user", "-u", "moed-watchdog.service"]
    assert seen[0][-1] == "-f" and seen[1][:4] == ["tail", "-n", "5", "-F"]
    assert seen[1][-1].endswith("daemon.log")


@pytest.mark.process
def test_macos_stop_then_start(tmp_path, fake_tools):
    bin_dir, state, calls = fake_tools
    env = service_env(tmp_path, bin_dir)
    env.update(FAKE_STATE=str(state), FAKE_PRINT=str(DATA / "launchctl_print_running.txt"))
    assert invoke(env, "install", "--platform", "macos").exit_code == 0

    # start on loaded jobs: bootstrap refuses (5), which start takes as "already there", then
    # kickstart.
    n = len(calls())
    result = invoke(env, "start", "--platform", "macos")
    assert result.exit_code == 0, result.output
    assert [c[1] for c in calls()[n:]] == ["bootstrap", "print", "kickstart"] * 2

    # stop unloads (KeepAlive would bring back a killed job); the plists stay for the next login.
    assert invoke(env, "stop", "--platform", "macos").exit_code == 0
    result = invoke(env, "status", "--platform", "macos")
    assert result.exit_code == 3
    assert result.output.count("not loaded (installed)") == 2

    n = len(calls())
    assert invoke(env, "start", "--platform", "macos").exit_code == 0
    assert [c[1] for c in calls()[n:]] == ["bootstrap", "kickstart"] * 2
    assert "loaded, running" in invoke(env, "status", "--platform", "macos").output
