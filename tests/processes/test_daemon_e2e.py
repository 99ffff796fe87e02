"""End to end through a real daemon process and the real client: exactness, concurrency, cancel."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from moed.client import DoneEvent, TokenEvent
from tests.fixtures.checkpoints import ARCHS
from tests.fixtures.reference import generate

pytestmark = pytest.mark.process

PROMPT = "def fibonacci(n):"
# On the seed-0 tiny qwen3_moe fixture, greedy decoding of this prompt meets no EOS for 3000 tokens.
LONG_PROMPT = "hello"


def daemon_tokens(client, prompt: str, max_tokens: int, **kw) -> tuple[list[int], DoneEvent]:
    ids, done = [], None
    for event in client.generate(prompt, max_tokens=max_tokens, raw=True, **kw):
        if isinstance(event, TokenEvent):
            ids += event.ids
        elif isinstance(event, DoneEvent):
            done = event
    return ids, done


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_mlx_lm(arch, checkpoint_factory, daemon_factory):
    model_path = checkpoint_factory(arch)
    d = daemon_factory(model_path, "--resident")
    with d.client() as c:
        got, done = daemon_tokens(c, PROMPT, 24)
    assert got == generate(model_path, PROMPT, 24)
    assert done.finish_reason in ("length", "stop")
    assert done.usage["completion_tokens"] == len(got)


def test_greedy_matches_mlx_lm_4bit(checkpoint_factory, daemon_factory):
    model_path = checkpoint_factory("qwen3_moe", bits=4)
    d = daemon_factory(model_path, "--resident")
    with d.client() as c:
        got, _ = daemon_tokens(c, PROMPT, 16)
    assert got == generate(model_path, PROMPT, 16)


def test_seeded_sampling_is_reproducible(daemon):
    with daemon.client() as c:
        a, _ = daemon_tokens(c, PROMPT, 20, temperature=1.0, top_p=0.9, seed=7)
        b, _ = daemon_tokens(c, PROMPT, 20, temperature=1.0, top_p=0.9, seed=7)
        other, _ = daemon_tokens(c, PROMPT, 20, temperature=1.0, top_p=0.9, seed=8)
        greedy, _ = daemon_tokens(c, PROMPT, 20)
    assert a == b
    assert a != other or a != greedy  # sampling actually samples


def test_two_clients_at_once_each_get_their_stream(daemon, tiny_model):
    expected = generate(tiny_model, PROMPT, 40)
    results: dict[int, list[int]] = {}

    def worker(n: int) -> None:
        with daemon.client() as c:
            results[n], _ = daemon_tokens(c, PROMPT, 40)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: expected, 1: expected}


def test_cancel_ends_stream_within_one_token(daemon):
    with daemon.client() as c:
        events = c.generate(LONG_PROMPT, max_tokens=2000, raw=True, request_id="long-1")
        seen = 0
        for event in events:
            if isinstance(event, TokenEvent):
                seen += len(event.ids)
                if seen == 3:
                    reply = c.cancel("long-1")
                    assert reply["cancelled"] is True
            if isinstance(event, DoneEvent):
                break
        assert event.finish_reason == "cancelled"
        # Counted by the daemon: tokens sent before it took the cancel, plus at most the one being
        # computed (and one already in the engine-to-transport pipe). Tokens the client had not
        # read yet are in flight, not generated after the cancel.
        assert event.usage["completion_tokens"] <= reply["tokens_sent"] + 2
        assert seen == event.usage["completion_tokens"]
        assert c.status()["active_requests"] == 0


def test_killed_client_leaves_daemon_serving(daemon, tiny_model):
    code = (
        "import sys; from moed.client import Client\n"
        f"c = Client({str(daemon.socket)!r})\n"
        "for e in c.generate('hello', max_tokens=100000, raw=True):\n"
        "    print('tok', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout.readline().startswith(b"tok")
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 10
    with daemon.client() as c:
        while c.status()["active_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.status()["active_requests"] == 0, "the dead client's generation was not cancelled"
        got, _ = daemon_tokens(c, PROMPT, 8)
    assert got == generate(tiny_model, PROMPT, 8)


def test_sigterm_drains_in_flight_and_exits_zero(daemon):
    with daemon.client() as c:
        events = c.generate(PROMPT, max_tokens=30, raw=True)
        first = next(events)
        assert isinstance(first, TokenEvent)
        daemon.proc.send_signal(signal.SIGTERM)
        rest = list(events)
    assert isinstance(rest[-1], DoneEvent) and rest[-1].finish_reason == "length"
    assert daemon.proc.wait(20) == 0
    assert not daemon.socket.exists()


def test_sigterm_past_deadline_cancels_with_terminal_error(daemon_factory, tiny_model, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[serve]\ndrain_timeout_s = 0.3\n")
    d = daemon_factory(tiny_model, "--resident", "--config", str(cfg))
    from moed.client import RequestFailed

    with d.client() as c:
        events = c.generate(LONG_PROMPT, max_tokens=100000, raw=True)
        next(events)
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(RequestFailed) as info:
            list(events)
    assert info.value.code.value == "shutting_down" and info.value.retryable
    assert d.proc.wait(20) == 0


def test_second_daemon_refuses_live_socket_and_replaces_stale(daemon, tiny_model, tmp_path):
    from tests.fixtures.daemon_harness import serve_command

    args = serve_command(tiny_model, daemon.socket, tmp_path / "s2", "--resident")
    second = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert second.returncode == 4
    assert "already serves" in second.stderr
    # A stale socket (its daemon died without cleanup) is replaced.
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    assert daemon.socket.exists()
    # A new daemon on the very same path: the probe finds nobody, so the stale file is removed.
    from tests.fixtures.daemon_harness import DaemonProcess

    log_path = tmp_path / "again.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            serve_command(tiny_model, daemon.socket, tmp_path / "s3", "--resident"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    again = DaemonProcess(daemon.socket, tmp_path / "s3", log_path, proc)
    try:
        assert again.wait_ready()["state"] == "ready"
        assert "removing stale socket" in again.log()
    finally:
        again.stop()


@pytest.mark.parametrize(
    "arch,budget,extra",
    [
        ("qwen3_moe", "10%", ()),
        ("mixtral", "50%", ()),
        ("deepseek_v3", "1", ()),
        ("olmoe", "25%", ("--prefetch-next",)),
        ("qwen3_moe", "25%", ("--lookahead",)),
    ],
)
def test_streaming_daemon_matches_resident_mlx_lm(
    arch, budget, extra, checkpoint_factory, daemon_factory
):
    """The default (streaming) daemon at small budgets gives the resident model's tokens, with
    telemetry."""
    model_path = checkpoint_factory(arch)
    d = daemon_factory(model_path, "--cache-budget", budget, *extra)
    with d.client() as c:
        got, done = daemon_tokens(c, PROMPT, 24)
        status = c.status()
    assert got == generate(model_path, PROMPT, 24)
    assert status["model"]["streaming"] is True
    assert "memory plan" in status["memory_plan"]
    experts = done.telemetry["experts"]
    assert experts["misses"] > 0 and experts["bytes_read"] > 0


def test_a_request_id_can_be_reused_after_a_cancel(daemon):
    """A cancel is tied to the request it named: the next request with the same id runs normally."""
    with daemon.client() as c:
        for n, event in enumerate(
            c.generate(LONG_PROMPT, max_tokens=2000, raw=True, request_id="again")
        ):
            if n == 0:
                assert c.cancel("again")["cancelled"] is True
            if isinstance(event, DoneEvent):
                assert event.finish_reason == "cancelled"
                break
        c.cancel("again")  # late: the request already ended, so this must not linger
        got, done = daemon_tokens(c, PROMPT, 8, request_id="again")
    assert done.finish_reason in ("length", "stop") and got


def test_a_stream_left_unread_is_cancelled(daemon):
    """Breaking out of generate() tells the daemon: it stops generating for nobody."""
    with daemon.client() as c:
        for _event in c.generate(LONG_PROMPT, max_tokens=5000, raw=True):
            break
        deadline = time.monotonic() + 10
        while c.status()["active_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.status()["active_requests"] == 0
        got, _ = daemon_tokens(
            c, PROMPT, 4
        )  # and the connection still works, with no stale replies
    assert got
