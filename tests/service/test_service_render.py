"""Rendered launchd plists and systemd units: parse, hold the required keys, pass
systemd-analyze."""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moed.daemon.config import load_config
from moed.daemon.service.render import (
    Role,
    ServiceManager,
    foreign_defaults,
    layout_for,
    make_context,
    render_plist,
    render_unit,
    systemd_quote,
    template_file,
)
from moed.protocol import paths
from tests.fixtures.daemon_harness import moed_command


def _ctx(tmp_path: Path, manager: ServiceManager, **serve):
    home = tmp_path / "home"
    env = {"HOME": str(home)}
    layout = layout_for(manager, env)
    overrides = {**foreign_defaults(manager, env), **serve}
    config = load_config(tmp_path / "absent.toml", environ={}, serve_overrides=overrides)
    return make_context(layout, config, python=sys.executable, uid=501)


@pytest.mark.process
@pytest.mark.parametrize("role", list(Role))
def test_plist_parses_and_holds_the_policy(tmp_path, role):
    ctx = _ctx(tmp_path, ServiceManager.LAUNCHD, drain_timeout_s=12.5)
    job = plistlib.loads(render_plist(ctx, role))
    home = tmp_path / "home"
    config = home / "Library" / "Application Support" / "moed" / "config.toml"
    assert job["Label"] == f"com.moed.{role.value}"
    assert job["ProgramArguments"] == _expected_args(ctx, role, config)
    assert Path(job["ProgramArguments"][0]).is_absolute()
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert isinstance(job["ThrottleInterval"], int) and job["ThrottleInterval"] >= 5
    assert job["ProcessType"] == "Interactive"
    log = home / "Library" / "Logs" / "moed" / f"{role.value}.log"
    assert job["StandardOutPath"] == job["StandardErrorPath"] == str(log)
    assert job["SoftResourceLimits"] == {"Core": 0}
    assert job["HardResourceLimits"] == {"Core": 0}
    assert job["EnvironmentVariables"]["MOED_CONFIG"] == str(config)
    if role is Role.DAEMON:
        # SIGKILL must not cut a graceful drain short: drain timeout (rounded up) plus a margin.
        assert job["ExitTimeOut"] >= 13 + 5
    else:
        assert job["ExitTimeOut"] > 0
    # No placeholder survives rendering.
    assert not any("@" in v for v in _strings(job))


def _expected_args(ctx, role: Role, config: Path) -> list[str]:
    if role is Role.GATEWAY:  # a client of the daemon's socket, not a reader of the config
        return moed_command("gateway", "--socket", str(ctx.config.serve.socket), "--port", "11435")
    return moed_command("serve" if role is Role.DAEMON else "watchdog", "--config", str(config))


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def test_plist_escapes_awkward_paths(tmp_path):
    # A home folder with XML metacharacters still renders a well-formed plist.
    odd = tmp_path / "a & <b>"
    layout = layout_for(ServiceManager.LAUNCHD, {"HOME": str(odd)})
    config = load_config(
        tmp_path / "absent.toml",
        environ={},
        serve_overrides=foreign_defaults(ServiceManager.LAUNCHD, {"HOME": str(odd)}),
    )
    ctx = make_context(layout, config, python="/opt/my env/bin/python", uid=501)
    job = plistlib.loads(render_plist(ctx, Role.DAEMON))
    assert job["ProgramArguments"][0] == "/opt/my env/bin/python"
    assert job["ProgramArguments"][-1].startswith(str(odd))


@pytest.mark.process
@pytest.mark.parametrize("role", list(Role))
def test_unit_holds_the_policy(tmp_path, role):
    ctx = _ctx(
        tmp_path, ServiceManager.SYSTEMD, drain_timeout_s=10, restart_budget=4, restart_window_s=300
    )
    text = render_unit(ctx, role)
    sections = _sections(text)
    unit, svc = sections["Unit"], sections["Service"]
    assert unit["StartLimitBurst"] == ["4"] and unit["StartLimitIntervalSec"] == ["300s"]
    config = tmp_path / "home" / ".config" / "moed" / "config.toml"
    assert shlex.split(svc["ExecStart"][0]) == _expected_args(ctx, role, config)
    assert svc["Restart"] == ["on-failure"]
    if role is Role.DAEMON:
        assert svc["RestartPreventExitStatus"] == [
            "2 3 4 6 8"
        ]  # config, model not found, already running, does not fit, no tokenizer
    assert int(svc["RestartSec"][0]) >= 5
    assert svc["KillSignal"] == ["SIGTERM"]
    assert svc["LimitCORE"] == ["0"]
    assert f"MOED_CONFIG={config}" in svc["Environment"]
    stop = int(svc["TimeoutStopSec"][0].rstrip("s"))
    assert stop >= (10 + 5 if role is Role.DAEMON else 1)
    assert sections["Install"]["WantedBy"] == ["default.target"]
    assert "@" not in text


def _sections(text: str) -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = out.setdefault(line.strip("[]"), {})
            continue
        key, value = line.split("=", 1)
        current.setdefault(key, []).append(value)
    return out


def test_systemd_quoting():
    assert systemd_quote("/usr/bin/python3") == "/usr/bin/python3"
    assert systemd_quote("/a b/c") == '"/a b/c"'
    assert systemd_quote("50%") == "50%%"
    assert systemd_quote("$HOME") == "$$HOME"
    assert systemd_quote('say "hi"') == '"say \\"hi\\""'


def test_host_layout_agrees_with_paths(tmp_path, monkeypatch):
    for var in ("MOED_CONFIG", "MOED_LOG_DIR", "MOED_STATE_DIR", "MOED_SOCKET", "MOED_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "st"))
    host = ServiceManager.of_host()
    assert layout_for(host).config_file == paths.config_path()
    defaults = foreign_defaults(host)
    assert defaults["log_dir"] == paths.log_dir()
    assert defaults["state_dir"] == paths.state_dir()


def test_templates_are_valid_as_shipped():
    for role in Role:
        plistlib.loads(template_file(ServiceManager.LAUNCHD, role).read_bytes())
        assert template_file(ServiceManager.SYSTEMD, role).read_text().startswith("#")


def test_the_platform_option_keeps_its_values():
    # `moed service --platform macos|linux` is user-facing: the rename to ServiceManager kept it.
    assert ServiceManager("macos") is ServiceManager.LAUNCHD
    assert ServiceManager("linux") is ServiceManager.SYSTEMD


def _analyze_env(tmp_path: Path) -> dict:
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}


@pytest.mark.process
@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_units_pass_systemd_analyze_verify(tmp_path):
    ctx = _ctx(tmp_path, ServiceManager.SYSTEMD)
    files = []
    for role in Role:
        path = tmp_path / role.unit
        path.write_text(render_unit(ctx, role))
        files.append(str(path))
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--user", *files],
        capture_output=True,
        text=True,
        env=_analyze_env(tmp_path),
        timeout=60,
    )
    # Unknown or malformed settings are only warnings ("..., ignoring"): demand silence too.
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


@pytest.mark.process
@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_systemd_analyze_catches_a_bad_unit(tmp_path):
    # The verify test above is only worth something if the tool complains about a broken unit here.
    ctx = _ctx(tmp_path, ServiceManager.SYSTEMD)
    bad = tmp_path / "moed.service"
    bad.write_text(render_unit(ctx, Role.DAEMON).replace("Restart=on-failure", "Restart=sometimes"))
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--user", str(bad)],
        capture_output=True,
        text=True,
        env=_analyze_env(tmp_path),
        timeout=60,
    )
    assert "sometimes" in proc.stdout + proc.stderr
