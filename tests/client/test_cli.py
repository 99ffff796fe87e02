"""The `moe` CLI as a user runs it: real processes, real daemon."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moed.client import DoneEvent
from moed.client.exit_codes import ExitCode
from moed.client.run_cli import summary_line
from tests.fixtures.daemon_harness import moe, moe_command


@pytest.mark.process
def test_run_json_stream_shape(daemon):
    out = moe(daemon.socket, "run", "--json", "--raw", "--max-tokens", "6", "--no-start", "def f")
    assert out.returncode == ExitCode.OK, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    kinds = [line["type"] for line in lines]
    assert kinds[-1] == "done" and kinds.count("done") == 1
    tokens = [line for line in lines if line["type"] == "token"]
    assert sum(len(t["ids"]) for t in tokens) == lines[-1]["usage"]["completion_tokens"] == 6
    assert all(isinstance(t["text"], str) for t in tokens)


@pytest.mark.process
def test_run_text_and_summary_and_stdin(daemon):
    out = moe(daemon.socket, "run", "--raw", "--max-tokens", "5", "--no-start", "-", input="hello")
    assert out.returncode == 0, out.stderr
    assert "[moe] 5 tokens" in out.stderr and "tok/s" in out.stderr


@pytest.mark.process
def test_run_error_is_typed_json_and_exit_code(daemon):
    out = moe(daemon.socket, "run", "--json", "--no-start", "--top-p", "3", "hi")
    assert out.returncode == ExitCode.REQUEST_FAILED
    last = json.loads(out.stdout.splitlines()[-1])
    assert last["type"] == "error" and last["code"] == "invalid_request"


@pytest.mark.process
def test_a_capped_max_tokens_is_said(daemon_factory, tiny_model):
    d = daemon_factory(tiny_model, "--resident", env={"MOED_MAX_TOKENS_LIMIT": "4"})
    out = moe(d.socket, "run", "--raw", "--no-start", "--json", "--max-tokens", "50", "def f")
    assert out.returncode == 0, out.stderr
    assert "--max-tokens 50 is over this daemon's limit; capped at 4" in out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["usage"]["completion_tokens"] == 4
    quiet = moe(d.socket, "run", "--raw", "--no-start", "--max-tokens", "3", "def f")
    assert quiet.returncode == 0 and "capped" not in quiet.stderr


@pytest.mark.process
def test_status_json_and_stop(daemon):
    out = moe(daemon.socket, "status", "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["state"] == "ready" and body["pid"] == daemon.proc.pid
    human = moe(daemon.socket, "status")
    assert "state        ready" in human.stdout
    assert moe(daemon.socket, "stop").returncode == 0
    assert daemon.proc.wait(20) == 0


@pytest.mark.process
def test_no_daemon_exit_codes(tmp_path):
    sock = Path(f"/tmp/moedt-none-{os.getpid()}/s.sock")
    assert moe(sock, "status").returncode == ExitCode.DAEMON_UNAVAILABLE
    out = moe(sock, "run", "--no-start", "--json", "hi")
    assert out.returncode == ExitCode.DAEMON_UNAVAILABLE
    assert json.loads(out.stdout.splitlines()[-1])["code"] == "daemon_unavailable"


@pytest.mark.process
def test_help_and_round_trip_never_import_mlx(daemon):
    probe = (
        "import sys\n"
        "from moed.client.cli import main\n"
        "from moed.client import Client\n"
        f"c = Client({str(daemon.socket)!r}); c.connect(); c.status()\n"
        "list(c.generate('hi', max_tokens=2, raw=True))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'moed')))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "mlx" not in out.stdout.replace("moed", "")
    assert "moed.daemon" not in out.stdout
    # What `moe --help` imports (-X importtime lists every module), rather than how long it takes.
    help_run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "moed.client.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_run.returncode == 0, help_run.stderr
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in help_run.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "moed.client" in imported  # the listing is really there
    assert not [m for m in imported if m.split(".")[0] in ("mlx", "mlx_lm")], imported
    assert not [m for m in imported if m.startswith("moed.daemon")], imported


@pytest.mark.process
def test_run_autostarts_a_daemon(tiny_model, tmp_path):
    sock_dir = Path(f"/tmp/moedt-auto-{os.getpid()}")
    sock = sock_dir / "s.sock"
    env = {"MOED_STATE_DIR": str(tmp_path / "state"), "MOED_RESIDENT": "1"}
    try:
        out = moe(
            sock, "run", "--raw", "--max-tokens", "4", "--model", str(tiny_model), "hello", env=env
        )
        assert out.returncode == 0, out.stderr
        assert "starting one" in out.stderr
        assert moe(sock, "status").returncode == 0  # it keeps running in the background
    finally:
        moe(sock, "stop")
        deadline = time.monotonic() + 20
        while sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert not sock.exists()


def test_model_from_local_hugging_face_cache(tiny_model, tmp_path, monkeypatch):
    from moed.daemon.model.source import ModelNotFound, resolve_model

    # The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}.
    repo = tmp_path / "hub" / "models--mlx-community--Tiny-MoE"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("mlx-community/Tiny-MoE") == (repo / "snapshots" / commit).resolve()
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):
        resolve_model("mlx-community/Absent-Model")


# The request must still run when the Ctrl-C lands: the tiny model decodes its whole context in
# ~10 s; 20 ms a step keeps it going for over a minute.
@pytest.mark.serial
@pytest.mark.process
def test_ctrl_c_cancels_the_request(daemon_factory, tiny_model):
    import signal

    env = {"MOED_DEBUG_FAULTS": "step_delay_ms=20"}
    daemon = daemon_factory(tiny_model, "--resident", env=env)
    cmd = moe_command(daemon.socket, "run", "--raw", "--no-start", "--max-tokens", "8000", "hello")
    # Ctrl-C as a terminal sends it: a suite started in the background (`cmd &` in a script) has
    # SIGINT ignored, and a child keeps an ignored SIGINT ignored (the run never saw the signal).
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    with daemon.client() as c:
        deadline = time.monotonic() + 30
        while c.status()["active_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == ExitCode.INTERRUPTED
        deadline = time.monotonic() + 10
        while c.status()["active_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.status()["active_requests"] == 0
    assert "cancelled" in proc.stderr.read().decode()


@pytest.mark.process
def test_status_offline_reports_last_crash_and_watchdog(daemon_factory, tiny_model, tmp_path):
    d = daemon_factory(tiny_model, "--resident", env={"MOED_DEBUG_FAULTS": "oom_after=2"})
    with d.client() as c:
        try:
            list(c.generate("hello", max_tokens=10, raw=True))
        except Exception:
            pass
    assert d.proc.wait(30) == 5
    out = moe(d.socket, "status", "--json", "--state-dir", str(d.state_dir))
    assert out.returncode == ExitCode.DAEMON_UNAVAILABLE
    body = json.loads(out.stdout.splitlines()[-1])
    assert body["last_crash"]["kind"] == "out_of_memory"


@pytest.mark.process
def test_run_model_names_the_served_model_in_any_spelling(daemon, tiny_model):
    """`--model ./folder` from another directory names the same served model: no refusal."""
    out = subprocess.run(
        moe_command(daemon.socket, "run", "--raw", "--no-start", "--max-tokens", "2", "--model",
                    f"./{tiny_model.name}", "def f"),
        cwd=tiny_model.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    other = moe(daemon.socket, "run", "--raw", "--no-start", "--json", "--model", "nobody/x", "x")
    assert other.returncode == ExitCode.REQUEST_FAILED
    assert json.loads(other.stdout.splitlines()[-1])["code"] == "model_not_found"


def test_the_summary_says_what_is_true_of_a_run_that_read_nothing():
    """Every layer routed on the device (all experts held): no lookups counted, so no hit rate
    of 0.0%, but that all were in memory."""
    timings = {"ttft_s": 0.01, "decode_tps": 50.0}
    usage = {"completion_tokens": 4, "prompt_tokens": 2}
    held = {"experts": {"hits": 0, "misses": 0, "bytes_read": 0, "device_routed": 32}}
    line = summary_line(DoneEvent("length", usage, timings, held))
    assert "experts all in memory" in line and "%" not in line
    read = {"experts": {"hits": 3, "misses": 1, "bytes_read": 4096}}
    assert "expert hits 75.0%" in summary_line(DoneEvent("length", usage, timings, read))


@pytest.mark.process
def test_run_on_another_model_is_served_without_the_demo_banner(daemon_factory, tiny_model):
    d = daemon_factory("demo", "--resident")
    other = moe(d.socket, "run", "--no-start", "--raw", "--max-tokens", "2", "--model",
                str(tiny_model), "def f")  # fmt: skip
    assert other.returncode == 0 and "demo model" not in other.stderr  # loaded on request
    unknown = moe(d.socket, "run", "--no-start", "--raw", "--model", "nobody/x", "def f")
    assert unknown.returncode == ExitCode.REQUEST_FAILED
    assert "model_not_found" in unknown.stderr and "demo model" not in unknown.stderr
    demo = moe(d.socket, "run", "--no-start", "--raw", "--max-tokens", "2", "def f")
    assert demo.returncode == 0 and "demo model" in demo.stderr  # said once the demo answers
