"""A follower rank's control socket answers a host's own `moed watchdog` (status, shed, leave)."""

from __future__ import annotations

import json
import subprocess
import time

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from moed.client import Client, RequestFailed
from moed.daemon.distributed.control import RankControl
from moed.daemon.experts import StreamingConfig, install_streaming
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import moed_command, short_socket_path

pytestmark = pytest.mark.process


@pytest.fixture
def rank_control(tiny_model):
    model, _ = load_model(tiny_model, lazy=True)
    streamer = install_streaming(
        model, tiny_model, StreamingConfig(cache_budget="100%", memory_bytes=8 << 30)
    )
    mx.eval(model.parameters())
    left: list[str] = []
    socket = short_socket_path()
    control = RankControl(
        socket,
        1,
        lambda: {"rank": 1, "rss_bytes": 1, "experts": {"resident_bytes": streamer.resident_bytes}},
        streamer.shed,
        left.append,
    )
    control.start()
    try:
        yield control, streamer, left
    finally:
        control.close()
        streamer.close()
        socket.parent.rmdir()


def test_watchdog_talks_to_a_follower_rank(rank_control):
    control, streamer, left = rank_control
    before = streamer.resident_bytes
    with Client(control.socket_path) as c:
        status = c.status()
        assert status["ranks"][0]["rank"] == 1 and status["busy"] is False
        assert c.shed()["accepted"]
        with pytest.raises(RequestFailed) as err:
            list(c.generate(prompt_ids=[1, 2, 3], max_tokens=2))
        assert err.value.code == ErrorCode.INVALID_REQUEST and "rank 0" in str(err.value)
        assert c.shutdown("swap keeps growing")["accepted"]
    # The rank leaves once the reply is out (rank 0 then restarts the group).
    deadline = time.monotonic() + 10
    while not left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left == ["swap keeps growing"]
    # The next token applies the shed on the rank's thread.
    streamer.begin_call(0, mx.array([[0, 1]]))
    assert streamer.resident_bytes < before
    # The host's own watchdog, unchanged, reads the rank's socket like a daemon's.
    once = subprocess.run(
        moed_command("watchdog", "--once", "--socket", str(control.socket_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert once.returncode == 0, once.stderr
    reading = json.loads(once.stdout)
    assert reading["readings"]["daemon"]["pid"] == status["pid"]
