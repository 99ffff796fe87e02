"""Every configuration error of `moed serve` exits 2 with one line naming the key, the value and
what is allowed, and no traceback; unknown keys are errors; the service units do not restart on
it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moed.daemon.config import ConfigError, load_config
from moed.daemon.ground.exit_codes import PERMANENT_EXITS, DaemonExit, for_supervisor
from tests.fixtures.daemon_harness import short_socket_path

CASES = [
    # (flags, environment, config file, words the message must hold)
    (["--cache-budget", "lots"], {}, "", ["cache_budget", "'lots'", "12GB"]),
    (["--log-level", "chatty"], {}, "", ["--log-level", "chatty", "debug"]),
    (["--metrics-port", "70000"], {}, "", ["metrics_port", "70000", "65535"]),
    ([], {"MOED_MAX_PENDING": "abc"}, "", ["max_pending", "MOED_MAX_PENDING", "'abc'", ">= 1"]),
    ([], {"MOED_TELEMETRY_EVERY": "0"}, "", ["telemetry_every", "'0'", ">= 1"]),
    ([], {"MOED_RESIDENT": "maybe"}, "", ["resident", "maybe", "true or false"]),
    ([], {"MOED_PROGRESS_DEADLINE_S": "nan"}, "", ["progress_deadline_s", "nan", "> 0"]),
    ([], {}, "[serve\n", ["not valid TOML"]),
    ([], {}, "[serve]\ncache_budjet = '25%'\n", ["unknown [serve]", "cache_budjet", "allowed"]),
    ([], {}, "[server]\nmodel = 'demo'\n", ["unknown section", "server"]),
    ([], {}, "[serve]\nmax_pending = 2.5\n", ["max_pending", "2.5", "integer"]),
    ([], {}, "[serve]\npage_cache = 'sometimes'\n", ["page_cache", "sometimes", "bypass"]),
    ([], {}, "[watchdog]\ninterval_s = -1\n", ["interval_s", "-1", "> 0"]),
]


@pytest.mark.process
@pytest.mark.parametrize("flags,env,toml,words", CASES, ids=[" ".join(c[3][:2]) for c in CASES])
def test_config_error_exits_2_with_key_value_and_allowed(tmp_path, flags, env, toml, words):
    config = tmp_path / "config.toml"
    config.write_text(toml)
    socket = short_socket_path()  # per process and call: two workers never share it
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.daemon.cli",
            "serve",
            "--socket",
            str(socket),
            "--state-dir",
            str(tmp_path / "state"),
            "--config",
            str(config),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in out.stderr, (word, out.stderr)
    assert not socket.exists()


def test_environment_values_are_checked_like_the_file():
    with pytest.raises(ConfigError, match="client_send_hwm"):
        load_config(Path("/nonexistent"), {"MOED_CLIENT_SEND_HWM": "1"})
    config = load_config(Path("/nonexistent"), {"MOED_RESIDENT": "yes", "MOED_MAX_PENDING": "3"})
    assert config.serve.resident is True and config.serve.max_pending == 3


def test_permanent_failures_are_not_restarted_by_either_service_manager():
    # systemd: RestartPreventExitStatus lists them (test_service_render checks the unit);
    # launchd cannot tell codes apart, so under it they exit 0 (KeepAlive SuccessfulExit=false).
    assert DaemonExit.CONFIG in PERMANENT_EXITS and DaemonExit.MODEL_UNUSABLE in PERMANENT_EXITS
    launchd = {"MOED_SUPERVISOR": "launchd"}
    assert for_supervisor(DaemonExit.CONFIG, launchd) == DaemonExit.OK
    assert for_supervisor(DaemonExit.OUT_OF_MEMORY, launchd) == DaemonExit.OUT_OF_MEMORY
    assert for_supervisor(DaemonExit.CONFIG, {}) == DaemonExit.CONFIG


@pytest.mark.process
def test_config_error_under_launchd_exits_0_after_saying_why(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.daemon.cli",
            "serve",
            "--cache-budget",
            "lots",
            "--state-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MOED_SUPERVISOR": "launchd"},
    )
    assert out.returncode == 0 and "cache_budget" in out.stderr
