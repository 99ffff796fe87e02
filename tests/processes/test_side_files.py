"""Side files never stop serving: a trace that cannot be written is dropped with a warning and the
request finishes; corrupt or misshapen state files are set aside as `*.corrupt`; a read-only state
directory means no persistence; a checkpoint that cannot tokenize is refused at load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moed.client import DoneEvent, TelemetryEvent, TokenEvent
from moed.daemon.experts.profile import profile_path
from moed.daemon.ground.watchdog_state import state_file_path

pytestmark = pytest.mark.process


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs (root only): a disk that fills up or turns read-only on demand."""
    mounted: list[Path] = []

    def mount(name: str, size: str = "1m") -> Path:
        path = tmp_path / name
        path.mkdir()
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount_read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def _fill(path: Path) -> None:
    """Fill a filesystem to the last byte."""
    for name, block in (("filler", 4096), ("filler2", 1)):
        try:
            with open(path / name, "wb", buffering=0) as f:
                while True:
                    f.write(b"\0" * block)
        except OSError:
            pass


def _run(client, prompt: str = "hello", max_tokens: int = 8) -> tuple[list, list]:
    events = list(client.generate(prompt, max_tokens=max_tokens, raw=True))
    warnings = [
        e.data["warning"] for e in events if isinstance(e, TelemetryEvent) and "warning" in e.data
    ]
    assert isinstance(events[-1], DoneEvent)
    return events, warnings


def test_unwritable_trace_is_dropped_and_the_request_finishes(daemon_factory, tiny_model, tmpfs):
    traces = tmpfs("traces")
    d = daemon_factory(tiny_model, "--cache-budget", "50%", "--trace-dir", str(traces))
    with d.client() as c:
        events, warnings = _run(c)
        assert not warnings and list(traces.glob("*.moetrace"))  # it traces when it can
        _fill(traces)
        events, warnings = _run(c)
        assert any(isinstance(e, TokenEvent) for e in events)
        assert warnings and "trace" in warnings[0] and "No space left" in warnings[0]
        for f in traces.glob("filler*"):
            f.unlink()
        _remount_read_only(traces)
        events, warnings = _run(c)
        assert warnings and "Read-only file system" in warnings[0]
        assert c.status()["state"] == "ready"
    assert d.proc.poll() is None


def test_corrupt_state_files_are_set_aside(daemon_factory, tiny_model, tmp_path):
    state = tmp_path / "d0" / "state"
    state.mkdir(parents=True)
    (state / "crash.json").write_text(json.dumps({"history": "not a list", "last": 3}))
    watchdog = state_file_path(state)
    watchdog.write_text(json.dumps({"pid": 1, "updated_at": "yesterday"}))
    profile = profile_path(state, tiny_model)
    profile.parent.mkdir(parents=True)
    profile.write_text("{not json")
    d = daemon_factory(tiny_model, "--cache-budget", "50%")
    with d.client() as c:
        status = c.status()
        _run(c)
    assert status["state"] == "ready" and status["watchdog"] is None
    assert status["last_crash"] is None and status["recent_crashes"] == 0
    for path in (state / "crash.json", watchdog, profile):
        assert path.with_name(path.name + ".corrupt").exists(), path
    log = d.log()
    assert log.count("set aside as") >= 3 and "Traceback" not in log


def test_read_only_state_directory_means_no_persistence(daemon_factory, tiny_model, tmpfs):
    state = tmpfs("state")
    _remount_read_only(state)
    d = daemon_factory(tiny_model, "--cache-budget", "50%", "--state-dir", str(state))
    with d.client() as c:
        _run(c)
        _run(c)
        assert c.status()["state"] == "ready"
    assert "cannot be written" in d.log() and "Traceback" not in d.log()
    assert d.stop() == 0


def test_checkpoint_without_tokenizer_is_refused_at_load(daemon_factory, tiny_model, tmp_path):
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, broken)
    for name in os.listdir(broken):
        if name.startswith(("tokenizer", "special_tokens")):
            (broken / name).unlink()
    d = daemon_factory(broken, "--resident", wait=False)
    code = d.proc.wait(120)
    assert code == 8, d.log()  # DaemonExit.MODEL_UNUSABLE: the service units do not restart it
    assert "tokenizer" in d.log()


def test_moe_status_offline_reads_misshapen_state_without_a_traceback(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "crash.json").write_text("[1, 2, 3]")
    state_file_path(state).write_text(json.dumps({"last_action": "shed"}))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.client.cli",
            "--socket",
            str(tmp_path / "none.sock"),
            "--state-dir",
            str(state),
            "status",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr
