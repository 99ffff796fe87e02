"""Crash recovery with real processes and real signals, under a supervisor that restarts the daemon
the way launchd's KeepAlive {SuccessfulExit: false, Crashed: true} does (and systemd's
Restart=on-failure): a non-zero exit or a death by signal is restarted, a clean exit is not.

- SIGKILL / SIGABRT mid-generation: the client gets a typed error from its liveness checks (the
  connection monitor, the heartbeat); with resume=True the caller's stream is identical to an
  uninterrupted run; the daemon serves again afterwards.
- An injected out-of-memory: `out_of_memory` to the client, crash.json written, exit code 5, and
  the next start reports the crash and takes a smaller expert cache.
- The restart budget: K crashes in the window and the daemon exits 0 and stays down, saying why.
- An injected hang: the engine stops producing tokens while the transport still answers pings;
  the progress watchdog kills it (SIGTERM, then SIGKILL) and the supervisor brings it back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moed.client import Client, DaemonUnavailable, DoneEvent, RequestFailed, TokenEvent
from moed.client.async_client import AsyncClient
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.watchdog.events import read_events
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import (
    Supervisor,
    moe_command,
    start_watchdog,
    stop_process,
)

pytestmark = [
    pytest.mark.serial,
    pytest.mark.process,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") and sys.platform != "darwin", reason="POSIX signals"
    ),
    pytest.mark.timeout(240),
]

# Greedy decoding of this prompt on the tiny fixture meets no EOS for thousands of tokens.
PROMPT = "hello"


def _reference(sup: Supervisor, max_tokens: int) -> tuple[list[int], str]:
    ids, text = [], []
    with Client(sup.socket) as c:
        for event in c.generate(PROMPT, max_tokens=max_tokens, raw=True):
            if isinstance(event, TokenEvent):
                ids += event.ids
                text.append(event.text)
    return ids, "".join(text)


def _crash_record(state_dir: Path) -> dict:
    return json.loads((state_dir / "crash.json").read_text())


# --- signals mid-generation ---------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT], ids=["SIGKILL", "SIGABRT"])
def test_signal_mid_generation_is_a_typed_error(sig, supervisor, tiny_model):
    sup = supervisor(tiny_model, "--resident")
    first = sup.wait_ready()
    tokens = 0
    with Client(sup.socket) as c:
        with pytest.raises(DaemonUnavailable) as err:  # DaemonRestarted is a DaemonUnavailable
            for event in c.generate(PROMPT, max_tokens=8000, raw=True):
                if isinstance(event, TokenEvent):
                    tokens += 1
                    if tokens == 50:
                        os.kill(first["pid"], sig)
                        killed_at = time.monotonic()
    noticed = time.monotonic() - killed_at
    print(f"\n{sig.name}: typed error {type(err.value).__name__} after {noticed:.2f}s")
    # Noticed by the connection monitor or the heartbeat (the two checks that bound it to about
    # dead_after_s), not by a request timeout; timing it is for a benchmark, not a loaded CI box.
    # A killed process is "gone" (its state read, a zombie counts), never taken for frozen.
    assert any(why in str(err.value) for why in ("is gone", "restarted")), err.value
    # The supervisor restarted it and it serves again.
    second = sup.wait_ready(not_boot=first["boot_id"])
    assert sup.exits[0] == -sig
    ids, _ = _reference(sup, 8)
    assert len(ids) == 8
    # The next start knows the previous run died without a word.
    assert (
        second["last_crash"]["kind"] == "unclean_exit"
        and second["last_crash"]["boot_id"] == first["boot_id"]
    )


def test_resume_after_sigabrt_gives_the_identical_stream(supervisor, tiny_model):
    # SIGABRT is what MLX before 0.32 does on a Metal OOM; SIGKILL is covered by `moe run --resume`.
    sig = signal.SIGABRT
    sup = supervisor(tiny_model, "--resident")
    first = sup.wait_ready()
    # Long enough (~1.5 s here) that the kill lands mid-stream, not after the daemon is done.
    ref_ids, ref_text = _reference(sup, 1000)
    ids, text, done = [], [], None
    with Client(sup.socket) as c:
        for event in c.generate(
            PROMPT, max_tokens=1000, raw=True, resume=True, resume_timeout_s=60
        ):
            if isinstance(event, TokenEvent):
                ids += event.ids
                text.append(event.text)
                if len(ids) == 100 and sup.exits == []:
                    os.kill(first["pid"], sig)
            elif isinstance(event, DoneEvent):
                done = event
    assert sup.exits == [-sig]  # it really died once, mid-stream
    # Its threads' stacks are in the log it died with (faulthandler), for whoever debugs it.
    assert "Fatal Python error: Aborted" in sup.logs[0].read_text(errors="replace")
    assert ids == ref_ids
    assert "".join(text) == ref_text
    assert (
        done.finish_reason == "length"
        and done.usage["completion_tokens"] == 1000
        and done.usage["resumes"] == 1
    )


def test_async_client_resumes_after_sigkill_with_the_identical_stream(supervisor, tiny_model):
    """AsyncClient.generate(resume=True) is Client's (client/resume.py): one stream across the
    daemon's death, the same tokens as an uninterrupted run."""
    sup = supervisor(tiny_model, "--resident")
    first = sup.wait_ready()
    ref_ids, ref_text = _reference(sup, 1000)

    async def read() -> tuple[list[int], list[str], DoneEvent | None]:
        ids, text, done = [], [], None
        async with AsyncClient(sup.socket) as c:
            async for event in c.generate(
                PROMPT, max_tokens=1000, raw=True, resume=True, resume_timeout_s=60
            ):
                if isinstance(event, TokenEvent):
                    ids += event.ids
                    text.append(event.text)
                    if len(ids) == 100 and sup.exits == []:
                        os.kill(first["pid"], signal.SIGKILL)
                elif isinstance(event, DoneEvent):
                    done = event
        return ids, text, done

    ids, text, done = asyncio.run(read())
    assert sup.exits == [-signal.SIGKILL]  # it really died once, mid-stream
    assert ids == ref_ids
    assert "".join(text) == ref_text
    assert done is not None and done.usage["completion_tokens"] == 1000
    assert done.usage["resumes"] == 1


def test_moe_run_resume(supervisor, tiny_model):
    sup = supervisor(tiny_model, "--resident")
    first = sup.wait_ready()
    _, ref_text = _reference(sup, 1000)
    cmd = moe_command(
        sup.socket, "run", "--raw", "--no-start", "--max-tokens", "1000", "--resume", PROMPT
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # Some text has arrived: the stream is under way. (A raw read: communicate() below reads the
        # pipe's descriptor and would miss anything a buffered read had pulled in.)
        out = os.read(proc.stdout.fileno(), 40)
        os.kill(first["pid"], signal.SIGKILL)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert (out + rest).decode() == ref_text + "\n"  # moe ends the text with a newline
    assert sup.exits == [-signal.SIGKILL]


# --- injected out-of-memory ---------------------------------------------------------------------


def test_injected_oom_fails_requests_records_the_crash_and_backs_off(supervisor, tiny_model):
    sup = supervisor(
        tiny_model, env={"MOED_DEBUG_FAULTS": "oom_after=20"}
    )  # streaming: a cache to shrink
    first = sup.wait_ready()
    full_budget = first["streaming"]["budget_bytes"]
    assert first["last_crash"] is None and first["budget_backoff"] is None
    with Client(sup.socket) as c:
        with pytest.raises(RequestFailed) as err:
            for _ in c.generate(PROMPT, max_tokens=200, raw=True):
                pass
    assert err.value.code is ErrorCode.OUT_OF_MEMORY and err.value.retryable
    assert "Insufficient Memory" in err.value.message
    second = sup.wait_ready(not_boot=first["boot_id"])
    assert sup.exits == [DaemonExit.OUT_OF_MEMORY]
    record = _crash_record(sup.state_dir)
    assert (
        record["last"]["kind"] == "out_of_memory" and record["last"]["boot_id"] == first["boot_id"]
    )
    assert "run" not in record or record["run"]["boot_id"] == second["boot_id"]
    # The next start: the crash is reported, and the cache budget is backed off.
    assert second["last_crash"]["kind"] == "out_of_memory"
    assert second["budget_backoff"]["factor"] == 0.5
    assert second["streaming"]["budget_bytes"] <= full_budget // 2 + 1
    with Client(sup.socket) as c:
        assert c.welcome["last_crash"]["kind"] == "out_of_memory"
    print(
        f"\ncache budget {full_budget} -> {second['streaming']['budget_bytes']} bytes after the OOM"
    )


def test_restart_budget_stops_the_restart_loop(supervisor, tiny_model):
    env = {
        "MOED_DEBUG_FAULTS": "oom_after=0",
        "MOED_RESTART_BUDGET": "2",
        "MOED_RESTART_WINDOW_S": "600",
    }
    sup = supervisor(tiny_model, "--resident", env=env)
    boot = None
    for _ in range(2):
        boot = sup.wait_ready(not_boot=boot)["boot_id"]
        with Client(sup.socket) as c:
            with pytest.raises(RequestFailed) as err:
                for _ in c.generate(PROMPT, max_tokens=5, raw=True):
                    pass
        assert err.value.code is ErrorCode.OUT_OF_MEMORY
    assert sup.finished.wait(60)
    # Two crashes, then a clean refusal: exit 0, which KeepAlive/systemd do not restart.
    assert sup.exits == [DaemonExit.OUT_OF_MEMORY, DaemonExit.OUT_OF_MEMORY, DaemonExit.OK]
    assert "restart budget spent" in sup.logs[-1].read_text()
    assert not sup.socket.exists()


# --- injected hang: the progress watchdog -------------------------------------------------------


def test_hung_engine_is_killed_by_the_progress_watchdog(supervisor, tiny_model, tmp_path):
    sup = supervisor(tiny_model, "--resident", env={"MOED_DEBUG_FAULTS": "hang_after=10"})
    first = sup.wait_ready()
    step_grace_s = 1.0
    watchdog = start_watchdog(
        sup.socket,
        sup.state_dir,
        tmp_path / "watchdog.log",
        *("--interval", "0.2", "--progress-timeout", "2", "--step-grace", str(step_grace_s)),
        *("--swap-growth-mb", "100000"),
    )
    try:
        tokens = 0
        last_token_at = None
        with Client(sup.socket) as c:
            # The hung daemon still answers heartbeats: the client waits until the watchdog acts.
            with pytest.raises(DaemonUnavailable):
                for event in c.generate(PROMPT, max_tokens=500, raw=True):
                    if isinstance(event, TokenEvent):
                        tokens += 1
                        last_token_at = time.monotonic()
        stuck_for = time.monotonic() - last_token_at
        assert tokens == 10
        second = sup.wait_ready(not_boot=first["boot_id"])
        actions = [
            e for e in read_events(sup.state_dir / "watchdog.jsonl") if e["event"] == "action"
        ]
        assert [a["action"] for a in actions] == ["sigterm", "sigkill"], actions
        assert all(a["rule"] == "progress" and a["outcome"]["ok"] for a in actions)
        assert "no token for" in actions[0]["reason"]
        assert sup.exits == [-signal.SIGKILL]
        gap = actions[1]["at"] - actions[0]["at"]
        print(
            f"\nhang: client error {stuck_for:.2f}s after the last token; "
            f"sigterm -> sigkill {gap:.2f}s"
        )
        # SIGKILL only after the SIGTERM had its grace (each action's `at`: when it was taken;
        # the event's `ts` comes after its log lines, a few ms later under load; wall-clock
        # times, which NTP may slew by up to 0.05%).
        assert gap >= step_grace_s * 0.9995
        # `moe status` shows the watchdog and what it did last.
        with Client(sup.socket) as c:
            st = c.status()
        assert st["watchdog"]["running"] and st["watchdog"]["last_action"]["action"] == "sigkill"
        assert second["last_crash"]["kind"] == "unclean_exit"
    finally:
        code = stop_process(watchdog, 10)
    assert code == 0
