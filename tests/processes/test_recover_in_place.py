"""A device out-of-memory inside a step, through real processes: a daemon (streaming and resident)
with three concurrent client streams, a gateway whose /health is polled all along, and a fault
raising the message MLX raises at a real sync point (ground/faults.py).

- In place: all three streams finish with the tokens of an uninterrupted run, the pid and boot id
  stay, nothing is loaded again, the budget (streaming) or prompt chunk (resident) is lower;
  `status`, `moe ps`, /health and Prometheus say `recovering`, then what was shed; the crash
  record keeps it for the next start's back-off and the watchdog's report file has it.
- A second out-of-memory within the window: exit 5, a restart with a smaller budget, and the
  streams resumed by recompute as before; /health never answered 200 once the engine was dead.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moed.client import DoneEvent
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.ground.watchdog_state import read_recovery
from tests.fixtures.daemon_harness import moe, run_together
from tests.fixtures.gateway_harness import start_gateway

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def ids(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 200 + 3 for i in range(n)]


STREAMS = [
    {"prompt_ids": ids(7, 1), "max_tokens": 40},
    {"prompt_ids": ids(11, 5), "max_tokens": 40, "temperature": 1.0, "top_p": 0.9, "seed": 11},
    {"prompt_ids": ids(60, 4), "max_tokens": 40},
]
# Each step sleeps this long: a recovery's catching up spans several /health polls.
SLOW_STEPS = "step_delay_ms=60"


@dataclass
class HealthLog:
    """GET /health every few ms on its own thread: (sent at, status code, body)."""

    url: str
    seen: list[tuple[float, int, dict]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                sent = time.time()
                try:
                    r = http.get(f"{self.url}/health")
                    self.seen.append((sent, r.status_code, r.json()))
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)

    def stop(self) -> list[tuple[float, int, dict]]:
        self._stop.set()
        self._thread.join(15)
        return self.seen


def tokens_of(results) -> list[list[int]]:
    assert all(isinstance(end, DoneEvent) for _, end in results), results
    return [got for got, _ in results]


@pytest.mark.parametrize(
    "mode, fault, kind",
    [
        ("streaming", "metal_oom_at_router=30", "out_of_memory"),
        ("resident", "metal_oom_at_eval=30", "out_of_memory"),
        # A GPU timeout halves the prompt chunk (a smaller command buffer) before anything else.
        ("streaming", "metal_timeout_at_eval=30", "gpu_timeout"),
    ],
)
def test_three_streams_survive_a_device_failure_in_place(
    mode, fault, kind, daemon_factory, tiny_model, tmp_path
):
    args = ("--resident",) if mode == "resident" else ("--cache-budget", "25%")
    env = {"MOED_DEBUG_FAULTS": f"{fault},{SLOW_STEPS}", "MOED_PREFILL_CHUNK": "16"}
    d = daemon_factory(tiny_model, *args, env=env)
    gateway = start_gateway(tmp_path / "g", d.socket)
    try:
        with d.client() as c:
            before = c.status()
        health = HealthLog(gateway.url)
        interrupted = tokens_of(run_together(d, STREAMS))
        seen = health.stop()
        with d.client() as c:
            after = c.status()
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        ps = moe(d.socket, "ps")
        status_text = moe(d.socket, "status")
        # The fault fired once: the same requests again are an uninterrupted run.
        uninterrupted = tokens_of(run_together(d, STREAMS))
    finally:
        gateway.stop()
    assert interrupted == uninterrupted
    assert all(len(got) == 40 for got in interrupted)
    # The same process, the model loaded once, one recovery from an out-of-memory.
    assert (after["pid"], after["boot_id"]) == (before["pid"], before["boot_id"])
    assert after["loads"] == 1 and after["requests_failed"] == 0
    other = {"out_of_memory": "gpu_timeout", "gpu_timeout": "out_of_memory"}[kind]
    assert after["recoveries"] == {kind: 1, other: 0}
    last = after["last_recovery"]
    assert last["phase"] == "recovered" and last["rows"] == 3 and last["kind"] == kind
    metal = {"out_of_memory": "OutOfMemory", "gpu_timeout": "Timeout"}[kind]
    assert f"kIOGPUCommandBufferCallbackError{metal}" in last["message"]
    if kind == "gpu_timeout":  # halved from the largest chunk the batch could read
        chunk = last["shed"]["prompt_chunk"]
        assert after["prompt_chunk_limit"] == chunk["to_tokens"] == chunk["from_tokens"] // 2
        assert after["streaming"]["budget_bytes"] == before["streaming"]["budget_bytes"]
    elif mode == "streaming":
        assert after["streaming"]["budget_bytes"] < before["streaming"]["budget_bytes"]
        assert "expert_budget" in last["shed"]
    else:
        assert after["prompt_chunk_limit"] < 16 and "prompt_chunk" in last["shed"]
    # /health: `recovering` (503) while the rows caught up, never a new pid, ready again.
    states = [(code, body["status"]) for _, code, body in seen]
    assert (503, "recovering") in states, states
    assert all(code == 200 for code, status in states if status == "ready")
    assert {body["daemon"]["pid"] for _, _, body in seen if body.get("daemon")} == {before["pid"]}
    assert states[-1] == (200, "ready")
    # Prometheus, `moe ps` and `moe status` say what happened.
    parsed = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert parsed[("moed_device_recoveries_total", (("kind", kind),))] == 1
    assert parsed[("moed_device_recoveries_total", (("kind", other),))] == 0
    assert parsed[("moed_state", (("state", "ready"),))] == 1
    if mode == "streaming" and kind == "out_of_memory":
        shed = parsed[("moed_last_recovery_shed_bytes", (("what", "expert_budget"),))]
        assert shed == before["streaming"]["budget_bytes"] - after["streaming"]["budget_bytes"]
    else:
        assert parsed[("moed_prompt_chunk_limit_tokens", ())] == after["prompt_chunk_limit"]
    assert f"recovered from {kind}" in ps.stdout
    counts = {kind: 1, other: 0}
    line = f"gpu_timeout {counts['gpu_timeout']}, out_of_memory {counts['out_of_memory']}"
    assert f"recovery     in_place; {line}" in status_text.stdout
    # The crash record keeps it for the back-off (not as a crash); the watchdog's file has it.
    record = json.loads((d.state_dir / "crash.json").read_text())
    # (a timeout asks nothing of the budget: the back-off's history does not keep it).
    kept = ["recovered_out_of_memory"] if kind == "out_of_memory" else []
    assert [e["kind"] for e in record["history"]] == kept
    assert record.get("last") is None
    report = read_recovery(d.state_dir)
    assert report["pid"] == before["pid"] and report["kind"] == kind


def test_a_second_out_of_memory_within_the_window_restarts_and_streams_resume(
    supervisor, tiny_model, tmp_path
):
    faults = f"metal_oom_at_eval=20,metal_oom_at_router=45,{SLOW_STEPS}"
    sup = supervisor(tiny_model, "--cache-budget", "25%", env={"MOED_DEBUG_FAULTS": faults})
    first = sup.wait_ready()
    sup.env.pop("MOED_DEBUG_FAULTS")  # the restarted daemon runs clean
    gateway = start_gateway(tmp_path / "g", sup.socket)
    try:
        health = HealthLog(gateway.url)
        resumed = tokens_of(
            run_together(sup, STREAMS, resume=True, resume_timeout_s=60, max_resumes=2)
        )
        second = sup.wait_ready(not_boot=first["boot_id"])
        time.sleep(0.3)  # a few polls of the new daemon
        seen = health.stop()
        uninterrupted = tokens_of(run_together(sup, STREAMS))
    finally:
        gateway.stop()
    assert resumed == uninterrupted
    assert sup.exits == [DaemonExit.OUT_OF_MEMORY]
    record = json.loads((sup.state_dir / "crash.json").read_text())
    crash = record["last"]
    assert crash["kind"] == "out_of_memory" and crash["boot_id"] == first["boot_id"]
    assert "a second out_of_memory within 60 s" in crash["message"]
    kinds = [e["kind"] for e in record["history"]]
    assert kinds == ["recovered_out_of_memory", "out_of_memory"]
    # The next start backs off twice: the recovery's halving and the crash's.
    assert second["budget_backoff"]["factor"] == 0.25
    assert second["streaming"]["budget_bytes"] < first["streaming"]["budget_bytes"]
    # /health never answered 200 from the moment the engine was known dead until the new daemon.
    dead_from = crash["at"]
    dead = [(code, body) for sent, code, body in seen if sent >= dead_from]
    until_new = []
    for code, body in dead:
        if (body.get("daemon") or {}).get("boot_id") == second["boot_id"]:
            break
        until_new.append(code)
    assert until_new and 200 not in until_new, until_new
    assert any(code == 503 for code in until_new)
