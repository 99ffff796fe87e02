"""`moed serve --pipeline 2`: a real daemon (rank 0) and a real follower rank over the ring backend.

Tokens through the daemon match the resident mlx-lm model; `moe status --json` lists both ranks;
a rank killed or frozen mid-stream gives the client a typed retryable error within 3 s, the
supervisor (standing in for launchd/systemd) restarts the group, and it serves again; an
architecture without pipeline support is refused at start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from mlx_lm.utils import load

from moed.client import Client, DoneEvent, RequestFailed, TokenEvent
from moed.daemon.ground.exit_codes import DaemonExit
from moed.protocol import ErrorCode
from tests.fixtures import pipeline_worker
from tests.fixtures.daemon_harness import Supervisor, moe_command, serve_command, short_socket_path
from tests.fixtures.pipeline_requests import PROMPT_IDS, tokens

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]

SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 7}


@pytest.fixture
def pipeline(supervisor, checkpoint_factory):
    def start(*args: str, env: dict | None = None) -> Supervisor:
        path = checkpoint_factory("qwen3_moe", num_layers=4)
        return supervisor(path, "--pipeline", "2", *args, env=env)

    return start


def test_pipeline_daemon_serves_the_resident_tokens(pipeline, checkpoint_factory):
    model, _ = load(str(checkpoint_factory("qwen3_moe", num_layers=4)))
    greedy = pipeline_worker.generate(model, PROMPT_IDS, pipeline_worker.SamplingParams())
    params = pipeline_worker.SamplingParams(**SEEDED)
    seeded = pipeline_worker.generate(model, PROMPT_IDS, params)
    del model

    sup = pipeline("--cache-budget", "25%")
    sup.wait_ready()
    with Client(sup.socket) as c:
        assert tokens(c, pipeline_worker.MAX_TOKENS) == greedy
        assert tokens(c, pipeline_worker.MAX_TOKENS, **SEEDED) == seeded
        # Cancel mid-stream: the request ends cancelled and the group keeps serving.
        for event in c.generate(prompt_ids=PROMPT_IDS, max_tokens=4000, request_id="long"):
            if isinstance(event, TokenEvent) and event.index == 5:
                c.cancel("long")
            if isinstance(event, DoneEvent):
                assert event.finish_reason == "cancelled"
        assert tokens(c, pipeline_worker.MAX_TOKENS) == greedy
    status = json.loads(
        subprocess.run(
            moe_command(sup.socket, "status", "--json"), capture_output=True, check=True
        ).stdout
    )
    human = subprocess.run(
        moe_command(sup.socket, "status"), capture_output=True, text=True, check=True
    ).stdout
    assert "rank 0" in human and "rank 1" in human and "layers [0, 2]" in human
    ranks = status["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["layers"] for r in ranks] == [[2, 4], [0, 2]]
    for r in ranks:
        assert r["host"] and r["pid"] and r["rss_bytes"] > 0
        assert 0 < r["experts"]["resident_bytes"] <= r["experts"]["budget_bytes"]
        assert r["experts"]["reads"] > 0 and 0 <= r["experts"]["hit_rate"] <= 1
    assert ranks[0]["link"]["bytes_per_token"] > 0


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_lost_rank_fails_requests_and_the_group_restarts(pipeline, how):
    # A frozen rank is noticed by its missing heartbeats (1 s here), a dead one at once.
    sup = pipeline("--cache-budget", "25%", env={"MOED_RANK_TIMEOUT_S": "1"})
    first = sup.wait_ready()
    follower = first["ranks"][1]["pid"]
    with Client(sup.socket) as c:
        with pytest.raises(RequestFailed) as err:
            for event in c.generate(prompt_ids=PROMPT_IDS, max_tokens=4000):
                if isinstance(event, TokenEvent) and event.index == 20:
                    os.kill(follower, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                    lost_at = time.monotonic()
    noticed = time.monotonic() - lost_at
    if how == "freeze":
        os.kill(follower, signal.SIGKILL)  # the group is gone; do not leave it stopped
    # The daemon's log says why when it is not: which thread saw what, and when.
    assert err.value.code == ErrorCode.RANK_FAILED and err.value.retryable, sup.log_text()[-6000:]
    assert noticed < 3.0, (noticed, sup.log_text()[-6000:])
    second = sup.wait_ready(not_boot=first["boot_id"])
    assert sup.exits == [DaemonExit.RANK_FAILED]
    assert second["ranks"][1]["pid"] != follower
    assert second["last_crash"]["kind"] == "rank_failed"
    with Client(sup.socket) as c:
        assert len(tokens(c, 8)) == 8


def test_a_failed_step_restarts_the_group(pipeline):
    # A step that raises on rank 0 leaves the followers inside its collectives: only a restart of
    # the whole group gets the ranks back in step, and the request gets the retryable error.
    sup = pipeline("--cache-budget", "25%", env={"MOED_DEBUG_FAULTS": "step_error_after=20"})
    first = sup.wait_ready()
    with Client(sup.socket) as c:
        with pytest.raises(RequestFailed) as err:
            for _ in c.generate(prompt_ids=PROMPT_IDS, max_tokens=4000):
                pass
    assert err.value.code == ErrorCode.RANK_FAILED and err.value.retryable
    assert "a pipeline step failed" in str(err.value)
    sup.wait_ready(not_boot=first["boot_id"])
    assert sup.exits[0] == DaemonExit.RANK_FAILED


def test_architecture_without_pipeline_support_is_refused(checkpoint_factory, tmp_path):
    socket = short_socket_path()
    cmd = serve_command(
        checkpoint_factory("mixtral"), socket, tmp_path / "state", "--pipeline", "2"
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == DaemonExit.CONFIG
    assert "'mixtral' has no pipeline support" in done.stderr
    assert "qwen3_moe" in done.stderr  # it says which architectures can


def test_resume_across_a_group_restart_and_a_clean_stop(pipeline):
    # 1500 tokens outrun a client on a loaded machine: a send queue that never calls it slow.
    sup = pipeline("--cache-budget", "25%", env={"MOED_CLIENT_SEND_HWM": "100000"})
    first = sup.wait_ready()
    with Client(sup.socket) as c:
        # Long enough that the kill lands while the daemon still generates.
        want = tokens(c, 1500)  # greedy: this model's seeded run ends at EOS within 30 tokens
    follower = first["ranks"][1]["pid"]
    got = []
    killed = False
    with Client(sup.socket) as c:
        for event in c.generate(
            prompt_ids=PROMPT_IDS, max_tokens=1500, resume=True, resume_timeout_s=120
        ):
            if isinstance(event, TokenEvent):
                got += event.ids
                # Once: tokens sent before rank 0 saw the loss still arrive after the kill.
                if len(got) >= 30 and not killed:
                    os.kill(follower, signal.SIGKILL)
                    killed = True
    assert sup.exits == [DaemonExit.RANK_FAILED]  # the group really restarted mid-stream
    assert got == want  # and the stream continued where it broke, token for token
    second = sup.wait_ready(not_boot=first["boot_id"])
    # A clean stop ends every rank: rank 0 says goodbye through the group, then exits 0.
    with Client(sup.socket) as c:
        c.shutdown("test done")
    sup.finished.wait(30)
    assert sup.exits == [DaemonExit.RANK_FAILED, DaemonExit.OK]
    new_follower = second["ranks"][1]["pid"]
    deadline = time.monotonic() + 10
    while _alive(new_follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(new_follower)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of an exited child still answers signal 0: look at its state.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"
