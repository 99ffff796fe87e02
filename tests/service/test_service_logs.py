"""Rotating log files and the start record."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from moed.daemon.ground.run_log import RotatingLog, read_start_records, record_start


def test_rotates_by_size_and_keeps_a_few_generations(tmp_path):
    path = tmp_path / "daemon.log"
    log = RotatingLog(path, max_bytes=100, backups=2, adopt_stdio=False)
    for i in range(38):  # 4 lines (120 bytes) per generation
        log.write(f"line {i:03d} " + "x" * 20)
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["daemon.log", "daemon.log.1", "daemon.log.2"]
    for p in tmp_path.iterdir():
        assert p.stat().st_size < 100 + 40
    # The newest lines are in the live file, the older in .1, then .2; older ones are gone.
    newest = path.read_text().splitlines()[-1]
    assert newest.startswith("line 037")
    older = (tmp_path / "daemon.log.1").read_text().splitlines()[-1]
    assert older.startswith("line 035")
    assert "line 000" not in "".join(p.read_text() for p in tmp_path.iterdir())


def test_over_size_file_from_the_last_run_starts_a_new_generation(tmp_path):
    path = tmp_path / "daemon.log"
    path.write_text("x" * 500)
    RotatingLog(path, max_bytes=100, backups=3, adopt_stdio=False).close()
    assert (tmp_path / "daemon.log.1").read_text() == "x" * 500
    assert path.read_text() == ""


def test_start_record_round_trip(tmp_path):
    log = record_start(tmp_path, "0.1.0", "/models/Qwen3 MoE", "12GB", "killed by Abort trap: 6")
    log.close()
    log = record_start(tmp_path, "0.1.0", "demo", 3_000_000, None)
    log.close()
    records = read_start_records(tmp_path / "daemon.log")
    assert [r["model"] for r in records] == ["/models/Qwen3 MoE", "demo"]
    assert records[0]["previous_exit"] == "killed by Abort trap: 6"
    assert records[0]["budget"] == "12GB" and records[1]["budget"] == "3000000"
    assert records[1]["previous_exit"] == "unknown"
    assert records[0]["version"] == "0.1.0" and records[0]["pid"].isdigit()


def test_start_records_survive_rotation(tmp_path):
    for i in range(5):
        record_start(tmp_path, "0.1.0", f"m{i}", "auto", None, max_bytes=150, backups=3).close()
    assert [r["model"] for r in read_start_records(tmp_path / "daemon.log")][-3:] == [
        "m2",
        "m3",
        "m4",
    ]


def test_logging_handler(tmp_path):
    log = RotatingLog(tmp_path / "daemon.log", adopt_stdio=False)
    logger = logging.getLogger("moed.test.service.logs")
    logger.propagate = False
    logger.addHandler(log.handler())
    logger.warning("cache shrunk to %s", "2GB")
    log.close()
    assert (
        "WARNING moed.test.service.logs: cache shrunk to 2GB"
        in (tmp_path / "daemon.log").read_text()
    )


@pytest.mark.process
def test_stdio_follows_rotation(tmp_path):
    # As under launchd: fds 1 and 2 are the log file itself. After a rotation, stray writes to
    # stderr (a traceback, a Metal abort message) must land in the current generation.
    path = tmp_path / "daemon.log"
    script = textwrap.dedent(
        f"""
        import os, sys
        from moed.daemon.ground.run_log import record_start
        log = record_start(
            {str(tmp_path)!r}, "0.1.0", "demo", "auto", None, max_bytes=200, backups=2
        )
        print("before rotation", file=sys.stderr, flush=True)
        log.write("y" * 300)   # past the bound: rotates
        print("after rotation", file=sys.stderr, flush=True)
        os.write(1, b"raw stdout\\n")
        """
    )
    with open(path, "ab") as f:
        proc = subprocess.run([sys.executable, "-c", script], stdout=f, stderr=f, timeout=60)
    assert proc.returncode == 0
    current = path.read_text()
    previous = (tmp_path / "daemon.log.1").read_text()
    assert "moed start" in previous and "before rotation" in previous
    assert "after rotation" in current and "raw stdout" in current
    assert "after rotation" not in previous


@pytest.mark.process
def test_adopt_logging_avoids_duplicates_when_stderr_is_the_log(tmp_path):
    path = tmp_path / "daemon.log"
    script = textwrap.dedent(
        f"""
        import logging, sys
        from moed.daemon.ground.run_log import record_start
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
        log = record_start({str(tmp_path)!r}, "0.1.0", "demo", "auto", None)
        assert log.owns_stderr()
        log.adopt_logging()
        logging.getLogger("moed").info("serving")
        log.record_exit(5, "out_of_memory")
        """
    )
    with open(path, "ab") as f:
        proc = subprocess.run([sys.executable, "-c", script], stdout=f, stderr=f, timeout=60)
    text = path.read_text()
    assert proc.returncode == 0, text
    assert text.count("serving") == 1
    assert "moed exit code=5" in text and "reason=out_of_memory" in text


def test_adopt_logging_keeps_stderr_elsewhere(tmp_path):
    log = RotatingLog(tmp_path / "daemon.log")
    assert not log.owns_stderr()  # pytest's stderr is not this file
    logger = logging.getLogger("moed.test.service.adopt")
    logger.propagate = False
    stream = logging.StreamHandler(sys.stderr)
    logger.addHandler(stream)
    handler = log.adopt_logging(logger)
    assert stream in logger.handlers and handler in logger.handlers
    logger.removeHandler(stream)
    logger.removeHandler(handler)
    log.close()
