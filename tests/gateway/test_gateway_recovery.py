"""The gateway when the daemon is busy or gone: 429 when it is full, 503 with Retry-After while it
restarts (no_daemon until the new one binds), and service again from the new daemon without
restarting the gateway."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.fixtures.daemon_harness import Supervisor
from tests.fixtures.gateway_harness import start_gateway

pytestmark = pytest.mark.process


def test_a_full_daemon_is_429_in_each_apis_shape(daemon_factory, tiny_model, tmp_path):
    daemon = daemon_factory(tiny_model, "--resident", env={"MOED_MAX_PENDING": "1"})
    gateway = start_gateway(tmp_path, daemon.socket)
    try:
        name = daemon.client().connect()["model"]["name"]
        oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        # This chat runs past 3000 tokens on the tiny model (no end of sequence): it stays busy.
        busy = oai.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "The quick brown fox"}],
            max_tokens=4000,
            stream=True,
        )
        next(iter(busy))  # the one allowed request is running
        with pytest.raises(openai.RateLimitError) as err:
            oai.completions.create(model=name, prompt="The", max_tokens=2)
        assert err.value.response.headers["retry-after"] == "1"
        refused = httpx.post(
            f"{gateway.url}/v1/messages",
            json={"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        )
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error"
        busy.close()
    finally:
        gateway.stop()


def test_503_while_the_daemon_restarts_then_service_resumes(tiny_model, tmp_path):
    (tmp_path / "s").mkdir()
    supervisor = Supervisor(tmp_path / "s", tiny_model, "--resident").start()
    gateway = None
    try:
        first = supervisor.wait_ready()
        gateway = start_gateway(tmp_path / "g", supervisor.socket)
        name = first["model"]["name"]
        oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        before = oai.completions.create(model=name, prompt="The quick", max_tokens=6)

        os.kill(first["pid"], signal.SIGKILL)  # a crash; the supervisor starts a new daemon
        seen = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = httpx.get(f"{gateway.url}/health", timeout=10)
            status = health.json()["status"]
            if status != "ready":
                assert health.status_code == 503 and health.headers["retry-after"]
            seen.add(status)
            if status == "ready" and health.json()["daemon"]["boot_id"] != first["boot_id"]:
                break
            time.sleep(0.05)
        # Nobody listens until the new daemon binds (no_daemon), then it loads: a tiny model may
        # load between two probes.
        assert seen & {"no_daemon", "restarting", "loading"}, seen
        after = oai.completions.create(model=name, prompt="The quick", max_tokens=6)
        assert after.choices[0].text == before.choices[0].text
    finally:
        if gateway is not None:
            gateway.stop()
        supervisor.stop()
