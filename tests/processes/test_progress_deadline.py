"""A wedged engine, no watchdog: the client fails with a typed, retryable `engine_stalled` instead
of waiting forever, new work is refused the same way, and status says `stalled`."""

from __future__ import annotations

import time

import pytest

from moed.client import RequestFailed, TokenEvent
from moed.protocol import ErrorCode

pytestmark = pytest.mark.process

DEADLINE_S = 1.0


def test_wedged_engine_fails_clients_with_engine_stalled(daemon_factory, tiny_model):
    d = daemon_factory(
        tiny_model,
        "--resident",
        env={"MOED_DEBUG_FAULTS": "hang_after=3", "MOED_PROGRESS_DEADLINE_S": str(DEADLINE_S)},
    )
    with d.client() as c:
        assert c.connect()["limits"]["progress_deadline_s"] == DEADLINE_S
        tokens = 0
        with pytest.raises(RequestFailed) as info:
            for event in c.generate("hello", max_tokens=50, raw=True):
                tokens += isinstance(event, TokenEvent)
                last_token = time.monotonic()
        failed_after = time.monotonic() - last_token
        assert info.value.code is ErrorCode.ENGINE_STALLED and info.value.retryable
        assert tokens >= 1
        # It took the deadline (plus the check interval), not forever.
        assert DEADLINE_S <= failed_after < DEADLINE_S * 10
        status = c.status()
        assert status["state"] == "stalled" and status["stalled"] is True
        assert status["progress_age_s"] > DEADLINE_S
        # The gateway's /health takes the daemon's verdict (its own deadline is longer).
        from moed.gateway.ops import Health, judge

        assert judge(status, stall_after_s=3600, now=time.time()) is Health.STALLED
        # New work is refused at once with the same typed error, while status keeps answering.
        with pytest.raises(RequestFailed) as again:
            list(c.generate("hello", max_tokens=5, raw=True))
        assert again.value.code is ErrorCode.ENGINE_STALLED
        assert c.ping()["pong"] is True
    assert d.proc.poll() is None


def test_status_reports_progress_while_healthy(daemon):
    with daemon.client() as c:
        list(c.generate("hello", max_tokens=3, raw=True))
        status = c.status()
    assert status["state"] == "ready" and status["stalled"] is False
    assert status["last_progress_at"] is not None and status["progress_age_s"] >= 0


# Each decoder layer of a prompt chunk is slowed by this much: the tiny checkpoints' two layers
# make one chunk outlast SLOW_DEADLINE_S while no gap between layers comes near it.
LAYER_DELAY_MS = 1200
SLOW_DEADLINE_S = 2.0


@pytest.mark.parametrize("mode", [("--resident",), ("--cache-budget", "50%")], ids=str)
def test_a_chunk_longer_than_the_deadline_completes(daemon_factory, tiny_model, mode):
    """Progress is counted per layer inside a step: a long but moving prompt chunk is no stall."""
    d = daemon_factory(
        tiny_model,
        *mode,
        env={
            "MOED_DEBUG_FAULTS": f"layer_delay_ms={LAYER_DELAY_MS}",
            "MOED_PROGRESS_DEADLINE_S": str(SLOW_DEADLINE_S),
        },
    )
    with d.client() as c:
        events = list(c.generate("hello there, a prompt of one chunk", max_tokens=3, raw=True))
        status = c.status()
    done = events[-1]
    assert done.finish_reason in ("length", "stop")
    # The chunk alone took longer than the deadline (two slowed layers), and nothing stalled.
    assert done.timings["ttft_s"] > SLOW_DEADLINE_S
    assert status["state"] == "ready" and status["stalled"] is False


def test_a_hang_inside_a_chunk_is_still_noticed(daemon_factory, tiny_model):
    """A wedge in the middle of a prompt chunk stops the layer beats: engine_stalled as before."""
    d = daemon_factory(
        tiny_model,
        "--resident",
        env={
            "MOED_DEBUG_FAULTS": "layer_hang_after=1",
            "MOED_PROGRESS_DEADLINE_S": str(DEADLINE_S),
        },
    )
    with d.client() as c:
        with pytest.raises(RequestFailed) as info:
            list(c.generate("hello there", max_tokens=5, raw=True))
        assert info.value.code is ErrorCode.ENGINE_STALLED and info.value.retryable
        assert c.status()["state"] == "stalled"
    assert d.proc.poll() is None
