"""Continuous batching across pipeline ranks: `moed serve --pipeline 2` runs concurrent requests
as one batch (a decode step of B rows is one forward through the ranks) with the tokens of the
single-process resident batch; cancel leaves the other rows alone; a lost rank fails every row
with the retryable `rank_failed` and the restarted group serves the batch again."""

from __future__ import annotations

import os
import signal

import pytest
from mlx_lm.utils import load

from moed.client import Client, DoneEvent, RequestFailed, TokenEvent
from moed.daemon.ground.exit_codes import DaemonExit
from moed.protocol import ErrorCode
from tests.fixtures import pipeline_worker
from tests.fixtures.daemon_harness import run_together, start_daemon
from tests.fixtures.pipeline_requests import rank_lists

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]

# An idle daemon gathers requests arriving within this window into one batch: every run of the
# same requests has the same batch composition, one process or two.
BATCH = ("--max-batch", "4", "--batch-window-ms", "1500")


def ids(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 200 + 3 for i in range(n)]


# Three clients: prompts of different lengths (the batch pads them), greedy and seeded rows, and
# rows that finish at different steps (the batch filters them out one by one).
REQUESTS = [
    {"prompt_ids": ids(5, 1), "max_tokens": 10},
    {"prompt_ids": ids(40, 5), "max_tokens": 16},
    {"prompt_ids": ids(9, 3), "max_tokens": 13, "temperature": 1.0, "top_p": 0.9, "seed": 11},
]


# Rows that would not end by themselves within 500 tokens (no end of sequence on this checkpoint).
LONG = [
    {"prompt_ids": ids(5, 1), "max_tokens": 500},
    {"prompt_ids": ids(12, 4), "max_tokens": 500, "temperature": 1.0, "top_p": 0.9, "seed": 11},
    {"prompt_ids": ids(15, 8), "max_tokens": 500},
]


@pytest.fixture(scope="module")
def model_path(checkpoint_factory):
    return checkpoint_factory("qwen3_moe", num_layers=4)


@pytest.fixture(scope="module")
def resident_batch(model_path, tmp_path_factory):
    """The single-process resident daemon's tokens for REQUESTS sent together."""
    d = start_daemon(tmp_path_factory.mktemp("resident"), model_path, "--resident", *BATCH)
    try:
        results = run_together(d, REQUESTS)
        with d.client() as c:
            assert c.status()["peak_running_requests"] == len(REQUESTS)  # really one batch
    finally:
        d.stop()
    expected = [got for got, _ in results]
    assert [len(got) for got in expected] == [r["max_tokens"] for r in REQUESTS], expected
    return expected


@pytest.mark.parametrize("budget", ["25%", "100%"])
def test_pipeline_batch_equals_the_resident_batch(supervisor, model_path, resident_batch, budget):
    model, _ = load(str(model_path))
    alone = pipeline_worker.generate(model, REQUESTS[1]["prompt_ids"], pipeline_worker.SEEDED)
    del model

    sup = supervisor(model_path, "--pipeline", "2", "--cache-budget", budget, *BATCH)
    sup.wait_ready()
    results = run_together(sup, REQUESTS)
    assert [got for got, _ in results] == resident_batch
    with sup.client() as c:
        status = c.status()
        # A request alone is plain mlx-lm's generation.
        seeded = {k: getattr(pipeline_worker.SEEDED, k) for k in ("temperature", "top_p", "seed")}
        got = []
        for event in c.generate(
            prompt_ids=REQUESTS[1]["prompt_ids"], max_tokens=pipeline_worker.MAX_TOKENS, **seeded
        ):
            if isinstance(event, TokenEvent):
                got += event.ids
        assert got == alone
    assert status["peak_running_requests"] == len(REQUESTS)
    # One forward per batched step: far fewer forwards than the rows' tokens.
    link = status["ranks"][0]["link"]
    decoded = sum(len(got) for got in resident_batch)
    assert link["steps_by_op"]["forward"] < decoded
    assert all(r["experts"]["reads"] > 0 for r in status["ranks"])
    # Once the requests ended, the only cache lists left are the prefix cache's entries, held on
    # both ranks; cleared, no twin is left behind.
    lists = [r["cache_lists"] for r in status["ranks"]]
    assert lists[0] == lists[1], lists
    with sup.client() as c:
        c.prefix_cache("clear")
        assert rank_lists(c, lambda n: n == [0, 0]) == [0, 0]


def together(sup, requests: list[dict], on_token) -> list:
    """run_together with request ids r0, r1, ... and each row's (tokens, finish reason or error)."""
    named = [{"request_id": f"r{n}", **r} for n, r in enumerate(requests)]
    results = run_together(sup, named, on_token=on_token)
    return [(got, end.finish_reason if isinstance(end, DoneEvent) else end) for got, end in results]


def test_cancel_and_a_lost_rank_in_a_pipeline_batch(supervisor, model_path, resident_batch):
    sup = supervisor(
        model_path, "--pipeline", "2", "--cache-budget", "25%", *BATCH,
        env={"MOED_RANK_TIMEOUT_S": "1"},
    )  # fmt: skip
    first = sup.wait_ready()

    def cancel_second(n: int, client: Client, got: list[int]) -> None:
        if n == 1 and len(got) == 3:
            client.cancel("r1")

    # Cancel the second row (long: it would run to its end of sequence) at its third token: the
    # other rows run on, unchanged.
    requests = [REQUESTS[0], {**REQUESTS[1], "max_tokens": 4000}, REQUESTS[2]]
    results = together(sup, requests, cancel_second)
    got, reason = results[1]
    assert reason == "cancelled" and len(got) < 4000
    assert got[:16] == resident_batch[1][: len(got)]
    assert [results[0][0], results[2][0]] == [resident_batch[0], resident_batch[2]]

    # Kill the follower while three rows decode (each would run 500 tokens): every row fails.
    follower = first["ranks"][1]["pid"]
    progress = [0] * len(LONG)

    def kill_follower(n: int, client: Client, got: list[int]) -> None:
        progress[n] = len(got)
        if min(progress) == 3:
            os.kill(follower, signal.SIGKILL)

    failed = together(sup, LONG, kill_follower)
    for got, err in failed:
        assert isinstance(err, RequestFailed), (got, err)
        assert err.code == ErrorCode.RANK_FAILED and err.retryable
        assert 3 <= len(got) < 500
    # The service restarts the group, which serves the same batch again.
    second = sup.wait_ready(not_boot=first["boot_id"])
    assert sup.exits == [DaemonExit.RANK_FAILED]
    assert second["ranks"][1]["pid"] != follower
    assert [got for got, _ in run_together(sup, REQUESTS)] == resident_batch
