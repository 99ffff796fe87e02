"""The `launchctl print gui/<uid>/<label>` parser, on recorded output of a real Mac, and
systemctl show."""

from __future__ import annotations

from pathlib import Path

import pytest

from moed.daemon.service import launchctl, systemd

DATA = Path(__file__).parents[1] / "data"


def recorded(name: str) -> str:
    return (DATA / f"launchctl_print_{name}.txt").read_text()


def test_running_agent():
    st = launchctl.parse_print(recorded("running"))
    assert st.loaded and st.running
    assert st.state == "running"  # not the nested coalitions' "state = active"
    assert st.pid == 4127
    assert st.runs == 1
    assert st.last_exit_code is None and st.last_exit_text == "(never exited)"
    assert st.last_signal is None
    assert st.last_exit() == "never exited"
    assert st.path == "/Users/ana/Library/LaunchAgents/com.moed.daemon.plist"
    assert st.arguments[-1] == "/Users/ana/Library/Application Support/moed/config.toml"
    assert st.arguments[:4] == (
        "/Users/ana/moed/.venv/bin/python",
        "-m",
        "moed.daemon.cli",
        "serve",
    )
    # What the plist asked for, as launchd understood it.
    assert st.spawn_type == "interactive (4)"
    assert st.minimum_runtime == 10  # ThrottleInterval
    assert st.exit_timeout == 25


def test_running_again_after_a_crash():
    # launchd brought the daemon back after a Metal abort: running, and the signal of the last end.
    st = launchctl.parse_print(recorded("restarted_after_crash"))
    assert st.running and st.pid == 5230 and st.runs == 3
    assert st.last_signal == "Abort trap: 6" and st.signal_number == 6
    assert st.last_exit_code is None
    assert st.last_exit() == "killed by Abort trap: 6"


def test_crashed_waiting_for_respawn():
    st = launchctl.parse_print(recorded("crashed"))
    assert st.loaded and not st.running
    assert st.state == "spawn scheduled"
    assert st.pid is None and st.runs == 4
    assert st.last_exit() == "killed by Abort trap: 6"


def test_exited_with_a_named_code():
    st = launchctl.parse_print(recorded("exited"))
    assert st.loaded and not st.running and st.state == "not running"
    assert st.pid is None
    assert st.last_exit_code == 78 and st.last_exit_text == "78: EX_CONFIG"
    assert st.last_exit() == "exited 78 (EX_CONFIG)"


def test_not_loaded_is_a_state():
    st = launchctl.state_from_result(113, "", recorded("not_loaded"))
    assert st.loaded is False and not st.running


def test_other_failures_raise():
    with pytest.raises(launchctl.LaunchctlError):
        launchctl.state_from_result(1, "", "Unrecognized target specifier.\n")


@pytest.mark.parametrize(
    "line,code,text",
    [
        ("0", 0, "exited 0"),
        ("1", 1, "exited 1"),
        ("-9", -9, "exited -9"),
        ("1: Operation not permitted", 1, "exited 1 (Operation not permitted)"),
    ],
)
def test_exit_code_forms(line, code, text):
    st = launchctl.parse_print(
        f"gui/501/x = {{\n\tstate = not running\n\tlast exit code = {line}\n}}\n"
    )
    assert st.last_exit_code == code and st.last_exit() == text


def test_command_lines():
    plist = Path("/Users/ana/Library/LaunchAgents/com.moed.daemon.plist")
    assert launchctl.bootstrap(501, plist) == ["launchctl", "bootstrap", "gui/501", str(plist)]
    assert launchctl.bootout(501, "com.moed.daemon") == [
        "launchctl",
        "bootout",
        "gui/501/com.moed.daemon",
    ]
    assert launchctl.kickstart(501, "com.moed.daemon", kill=True) == [
        "launchctl",
        "kickstart",
        "-k",
        "gui/501/com.moed.daemon",
    ]
    assert launchctl.print_(501, "com.moed.daemon") == [
        "launchctl",
        "print",
        "gui/501/com.moed.daemon",
    ]


SHOW_RUNNING = """LoadState=loaded
ActiveState=active
SubState=running
UnitFileState=enabled
MainPID=812
ExecMainCode=0
ExecMainStatus=0
Result=success
NRestarts=0
"""

SHOW_RESTARTING = """LoadState=loaded
ActiveState=activating
SubState=auto-restart
UnitFileState=enabled
MainPID=0
ExecMainCode=2
ExecMainStatus=6
Result=signal
NRestarts=2
"""

SHOW_NOT_FOUND = """LoadState=not-found
ActiveState=inactive
SubState=dead
UnitFileState=
MainPID=0
ExecMainCode=0
ExecMainStatus=0
Result=success
NRestarts=0
"""


def test_systemctl_show():
    st = systemd.parse_show(SHOW_RUNNING)
    assert st.loaded and st.running and st.pid == 812 and st.last_exit() is None
    st = systemd.parse_show(SHOW_RESTARTING)
    assert st.loaded and not st.running and st.pid is None and st.restarts == 2
    assert st.last_exit() == "killed by signal 6 (signal)"
    st = systemd.parse_show(SHOW_NOT_FOUND)
    assert not st.loaded and not st.running


def test_daemon_exit_codes_are_named():
    from moed.daemon.service.backend import _name_exit
    from moed.daemon.service.render import Role

    assert _name_exit(Role.DAEMON, "exited 3", 3) == "exited 3 [MODEL_NOT_FOUND]"
    assert _name_exit(Role.DAEMON, "exited 0", 0) == "exited 0"
    assert _name_exit(Role.WATCHDOG, "exited 3", 3) == "exited 3"
    assert _name_exit(Role.DAEMON, "exited 77", 77) == "exited 77"


class _Run:
    def __init__(self, name: str, code: int = 0):
        self.name, self.code, self.argv = name, code, None

    def __call__(self, argv):
        import subprocess

        self.argv = argv
        text = recorded(self.name)
        return subprocess.CompletedProcess(
            argv, self.code, text if self.code == 0 else "", text if self.code else ""
        )


def test_previous_exit_from_inside_a_launchd_job():
    env = {"XPC_SERVICE_NAME": "com.moed.daemon"}
    run = _Run("restarted_after_crash")
    assert launchctl.previous_exit(env, run) == "killed by Abort trap: 6"
    assert run.argv[:2] == ["launchctl", "print"] and run.argv[2].endswith("/com.moed.daemon")
    # First run since load: nothing before it.
    assert launchctl.previous_exit(env, _Run("running")) is None
    assert launchctl.previous_exit(env, _Run("not_loaded", 113)) is None
    # Not under launchd at all.
    assert launchctl.previous_exit({}, _Run("restarted_after_crash")) is None
