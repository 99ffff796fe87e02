"""Poison-request protection: a request in flight at two crashes of the daemon is refused, not
replayed into a third; other requests are served."""

from __future__ import annotations

import resource

import pytest

from moed.client import DaemonUnavailable, RequestFailed, TokenEvent
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import start_daemon

pytestmark = pytest.mark.process

POISON = {"prompt_ids": [5, 6, 7], "max_tokens": 12}


def _no_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_request_in_flight_at_two_crashes_is_refused(tmp_path, tiny_model):
    crashing = {"MOED_DEBUG_FAULTS": "abort_after=2", "MOED_RESTART_BUDGET": "10"}
    for _ in range(2):  # the same request takes the daemon down twice (SIGABRT mid-generation)
        d = start_daemon(
            tmp_path, tiny_model, "--resident", env=crashing, preexec_fn=_no_core_dumps
        )
        try:
            with d.client() as c, pytest.raises(DaemonUnavailable):
                list(c.generate(**POISON))
            assert d.proc.wait(30) != 0
        finally:
            d.stop()
    d = start_daemon(tmp_path, tiny_model, "--resident", env={"MOED_RESTART_BUDGET": "10"})
    try:
        with d.client() as c:
            assert c.connect()["last_crash"]["kind"] == "unclean_exit"
            with pytest.raises(RequestFailed) as info:
                list(c.generate(**POISON))
            assert info.value.code is ErrorCode.POISON_REQUEST and not info.value.retryable
            # Any other request (even the same prompt with another max_tokens) is served.
            other = list(c.generate(prompt_ids=[5, 6, 7], max_tokens=3))
            assert any(isinstance(e, TokenEvent) for e in other)
            assert c.status()["recent_crashes"] == 2
    finally:
        d.stop()
