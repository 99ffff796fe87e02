"""Liveness by the connection, not by silence (issue 23 part 7), on a loaded machine: a real CPU
hog runs beside the daemon. A daemon whose step keeps every Python thread from running (the GIL
held longer than the clients' 3 s) is alive, and its clients keep waiting; a frozen daemon
(SIGSTOP) is still noticed, by the sync client and by the gateway's asyncio client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from moed.client import DaemonUnavailable, DoneEvent
from moed.client.async_client import AsyncClient

pytestmark = [pytest.mark.serial, pytest.mark.process]

# Each of the tiny checkpoint's two layers of a prompt chunk holds the GIL this long: the
# transport thread answers nothing for longer than a client's 3 s `dead_after_s`.
GIL_HOLD_MS = 4000
# A prompt chunk that takes a while (sleeping, the transport answers), to freeze the daemon inside.
SLOW_LAYER_MS = 3000
PROMPT = "a long prompt that keeps the engine busy"


@pytest.fixture
def cpu_hog():
    """A real busy process beside the daemon for the whole test."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield hog
    hog.kill()
    hog.wait()


def _starved_daemon(daemon_factory, tiny_model):
    return daemon_factory(
        tiny_model, "--resident", env={"MOED_DEBUG_FAULTS": f"layer_gil_ms={GIL_HOLD_MS}"}
    )


def test_a_step_holding_the_gil_is_not_a_death(daemon_factory, tiny_model, cpu_hog):
    d = _starved_daemon(daemon_factory, tiny_model)
    with d.client() as c:
        assert c.dead_after_s * 1000 < GIL_HOLD_MS
        events = list(c.generate(PROMPT, max_tokens=3, raw=True))
    assert isinstance(events[-1], DoneEvent)
    # The silence really was longer than dead_after_s: each slowed layer held the GIL.
    assert events[-1].timings["ttft_s"] * 1000 > 2 * GIL_HOLD_MS


def test_the_async_client_waits_out_a_step_holding_the_gil(daemon_factory, tiny_model, cpu_hog):
    d = _starved_daemon(daemon_factory, tiny_model)

    async def run() -> list:
        async with AsyncClient(d.socket) as c:
            return [e async for e in c.generate(prompt=PROMPT, max_tokens=3, raw=True)]

    events = asyncio.run(run())
    assert isinstance(events[-1], DoneEvent)
    assert events[-1].timings["ttft_s"] * 1000 > 2 * GIL_HOLD_MS


def _slow_daemon(daemon_factory, tiny_model):
    return daemon_factory(
        tiny_model, "--resident", env={"MOED_DEBUG_FAULTS": f"layer_delay_ms={SLOW_LAYER_MS}"}
    )


def _freeze_when_running(d) -> None:
    """SIGSTOP the daemon once its engine holds the request (asked on a second connection)."""
    with d.client() as watcher:
        while watcher.status()["running_requests"] < 1:
            time.sleep(0.05)
    os.kill(d.proc.pid, signal.SIGSTOP)


def _frozen_during(d, run):
    """`run()` while a thread SIGSTOPs the daemon once it holds the request; SIGCONT after."""
    freezer = threading.Thread(target=_freeze_when_running, args=(d,))
    freezer.start()
    try:
        return run()
    finally:
        freezer.join()
        os.kill(d.proc.pid, signal.SIGCONT)


def test_a_frozen_daemon_is_noticed(daemon_factory, tiny_model, cpu_hog):
    d = _slow_daemon(daemon_factory, tiny_model)

    def run() -> None:
        with d.client() as c, pytest.raises(DaemonUnavailable, match="stopped answering"):
            list(c.generate(PROMPT, max_tokens=3, raw=True))

    _frozen_during(d, run)


def test_the_async_client_notices_a_frozen_daemon(daemon_factory, tiny_model, cpu_hog):
    d = _slow_daemon(daemon_factory, tiny_model)

    async def generate() -> None:
        async with AsyncClient(d.socket) as c:
            with pytest.raises(DaemonUnavailable, match="stopped answering"):
                [e async for e in c.generate(prompt=PROMPT, max_tokens=3, raw=True)]

    _frozen_during(d, lambda: asyncio.run(generate()))


def test_the_gateway_answers_through_a_step_holding_the_gil(
    daemon_factory, tiny_model, cpu_hog, tmp_path
):
    """The issue's symptom: the gateway took a busy daemon for dead after 3 s of silence and
    answered 503; now the request is answered."""
    import httpx

    from tests.fixtures.gateway_harness import start_gateway

    d = _starved_daemon(daemon_factory, tiny_model)
    gateway = start_gateway(tmp_path / "g", d.socket)
    try:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        gateway.stop()
