"""Each daemon start is recorded in the rotating daemon.log with why the previous run ended."""

from __future__ import annotations

import signal

import pytest

from moed.daemon.ground.run_log import read_start_records

pytestmark = pytest.mark.process


def test_start_records_carry_model_budget_and_previous_exit(daemon_factory, tiny_model, tmp_path):
    first = daemon_factory(tiny_model, "--cache-budget", "50%")
    log_path = tmp_path / "d0" / "logs" / "daemon.log"
    first.proc.send_signal(signal.SIGKILL)  # dies without a word: the next start must say so
    first.proc.wait()
    env_state = {"MOED_LOG_DIR": str(tmp_path / "d0" / "logs")}
    second = daemon_factory(
        tiny_model, "--cache-budget", "50%", "--state-dir", str(first.state_dir), env=env_state
    )
    assert second.stop() == 0
    records = read_start_records(log_path)
    assert len(records) == 2
    assert records[0]["model"] == str(tiny_model) and records[0]["budget"] == "50%"
    assert "unclean_exit" in records[1]["previous_exit"]
    assert "no exit record" in records[1]["previous_exit"]  # the log's own word agrees
    # Right after a logged clean exit, the next start says so (not "unknown").
    third = daemon_factory(
        tiny_model, "--cache-budget", "50%", "--state-dir", str(first.state_dir), env=env_state
    )
    assert third.stop() == 0
    records = read_start_records(log_path)
    assert records[2]["previous_exit"].startswith("clean exit (ok) at ")
    text = log_path.read_text()
    assert (
        "moed exit code=0" in text and "model loaded" in text
    )  # logging goes through the rotating file
