"""A device failure inside a step, recovered in place (engine/recovery.py), in-process: each real
message MLX raises (ground/faults.py DEVICE_MESSAGES) at each real sync point, with three streams
(greedy, sampled with a seed, and one that joins late with a prompt read in chunks), streaming and
resident. Every stream ends with exactly the tokens of an uninterrupted run, the model is not
loaded again, and the expert budget (out of memory) or the prompt chunk (timeout) is lower."""

from __future__ import annotations

import pytest

from moed.daemon.config import ServeConfig
from moed.daemon.engine.core import EngineCore
from moed.daemon.engine.status import DaemonState, EngineStatus
from moed.daemon.ground.device_errors import DeviceFailure, classify
from moed.daemon.ground.faults import DEVICE_MESSAGES, DeviceMessage, SyncPoint
from moed.protocol import ErrorCode
from tests.fixtures.engine_driver import ListSink, run_until_idle, submit
from tests.fixtures.matrix import first_fast


def ids(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 200 + 3 for i in range(n)]


STREAMS = {
    0: {"prompt_ids": ids(7, 1), "max_tokens": 36},
    1: {"prompt_ids": ids(11, 5), "max_tokens": 36, "temperature": 1.0, "top_p": 0.9, "seed": 11},
    2: {"prompt_ids": ids(90, 4), "max_tokens": 24},  # joins late: read in chunks beside the rest
}
LATE_AT = 8  # tokens sent before the third stream joins
FAIL_AT = 14  # tokens sent before the fault fires: the third stream's prompt is being read
PREFILL_CHUNK = 16

MESSAGES = [
    DeviceMessage.METAL_OOM,
    DeviceMessage.METAL_MALLOC,
    DeviceMessage.CUDA_OOM,
    DeviceMessage.METAL_TIMEOUT,
    DeviceMessage.METAL_INTERACTIVITY,
]
CASES = [
    (mode, point, message)
    for mode, points in (
        ("streaming", (SyncPoint.ROUTER, SyncPoint.FENCE, SyncPoint.EVAL, SyncPoint.CHUNK)),
        ("resident", (SyncPoint.EVAL, SyncPoint.CHUNK)),
    )
    for point in points
    for message in MESSAGES
]


def make_core(model, state_dir, mode: str, faults: str = "", **settings) -> EngineCore:
    serve = ServeConfig(
        model=str(model),
        state_dir=state_dir,
        resident=mode == "resident",
        # 2 of 8 experts a layer: the late prompt's chunks need passes, and fences between them.
        cache_budget="25%",
        prefill_chunk=PREFILL_CHUNK,
        debug_faults=faults,
        **settings,
    )
    core = EngineCore(serve, model, ListSink(), EngineStatus())
    assert core.load()
    return core


def start(core: EngineCore, n: int) -> None:
    stream = dict(STREAMS[n])
    submit(core, n, stream.pop("prompt_ids"), **stream)


def run_three(core: EngineCore) -> dict[int, list[int]]:
    """Two streams, then the third once LATE_AT tokens went out; every stream's tokens."""
    for n in (0, 1):
        start(core, n)
    while core.status.get("tokens_generated") < LATE_AT:
        core.step()
    start(core, 2)
    run_until_idle(core)
    ends = {n: core.sink.of(n)[-1] for n in STREAMS}
    assert all(end["type"] == "done" for end in ends.values()), ends
    return {n: core.sink.tokens(n) for n in STREAMS}


_CLEAN: dict[str, dict[int, list[int]]] = {}


def uninterrupted(model, tmp_path, mode: str) -> dict[int, list[int]]:
    if mode not in _CLEAN:
        core = make_core(model, tmp_path / "clean", mode)
        try:
            _CLEAN[mode] = run_three(core)
        finally:
            core.close()
    return _CLEAN[mode]


@pytest.mark.parametrize(
    "mode, point, message",
    first_fast(CASES, [f"{m}-{p.value}-{msg.value}" for m, p, msg in CASES]),
)
def test_a_device_failure_at_a_sync_point_is_recovered_in_place(
    mode, point, message, tiny_model, tmp_path
):
    expected = uninterrupted(tiny_model, tmp_path, mode)
    kind = classify(RuntimeError(DEVICE_MESSAGES[message]))
    core = make_core(
        tiny_model, tmp_path / "f", mode, f"{message.value}_at_{point.value}={FAIL_AT}"
    )
    try:
        before = core.status.snapshot()
        got = run_three(core)
        after = core.status.snapshot()
        streamer = core.loaded.streamer
        fences = streamer.counters.fences if streamer is not None else None
    finally:
        core.close()
    assert got == expected
    assert after["recoveries"] == {
        DeviceFailure.OUT_OF_MEMORY.value: int(kind is DeviceFailure.OUT_OF_MEMORY),
        DeviceFailure.GPU_TIMEOUT.value: int(kind is DeviceFailure.GPU_TIMEOUT),
    }
    assert after["loads"] == before["loads"] == 1  # nothing loaded again
    assert after["state"] == DaemonState.READY.value and after["requests_failed"] == 0
    last = after["last_recovery"]
    assert last["kind"] == kind.value and last["phase"] == "recovered"
    assert last["message"] == DEVICE_MESSAGES[message] and last["rows"] >= 2
    if kind is DeviceFailure.GPU_TIMEOUT or mode == "resident":  # the chunk is the lever
        # Halved from the largest chunk the batch could read (a lone prompt's, from the plan).
        chunk = last["shed"]["prompt_chunk"]
        assert chunk["from_tokens"] >= PREFILL_CHUNK
        assert after["prompt_chunk_limit"] == chunk["to_tokens"] == chunk["from_tokens"] // 2
    else:  # out of memory, streaming: one back-off step of the expert budget
        assert after["prompt_chunk_limit"] is None
        assert after["streaming"]["budget_bytes"] == before["streaming"]["budget_bytes"] // 2
        assert last["shed"]["expert_budget"]["to_bytes"] == after["streaming"]["budget_bytes"]
    if point is SyncPoint.FENCE:
        assert fences > 0


def test_a_second_failure_of_a_kind_within_the_window_takes_the_restart_path(tiny_model, tmp_path):
    faults = "metal_oom_at_eval=6,metal_oom_at_router=20"
    core = make_core(tiny_model, tmp_path, "streaming", faults)
    try:
        for n in (0, 1):
            start(core, n)
        run_until_idle(core)
    finally:
        core.close()
    assert core.status.get("recoveries")[DeviceFailure.OUT_OF_MEMORY.value] == 1
    assert core.fatal is not None and core.exit_code == 5
    assert core.status.get("state") == DaemonState.FAILED.value
    assert "a second out_of_memory within 60 s" in core.status.get("error")
    ends = [core.sink.of(n)[-1] for n in (0, 1)]
    assert [e["code"] for e in ends] == [ErrorCode.OUT_OF_MEMORY.value] * 2


def test_a_failure_while_recovering_and_another_kind_of_device_error_restart(tiny_model, tmp_path):
    # A timeout while the rows of an out-of-memory recovery are still read again.
    core = make_core(
        tiny_model, tmp_path / "a", "resident", "metal_oom_at_eval=6,metal_timeout_at_chunk=6"
    )
    try:
        for n in (0, 1):
            start(core, n)
        run_until_idle(core)
    finally:
        core.close()
    assert core.exit_code == 5 and "while recovering from out_of_memory" in core.status.get("error")
    # A device error that is neither memory nor a timeout: never in place.
    core = make_core(tiny_model, tmp_path / "b", "resident", "metal_internal_at_eval=6")
    try:
        start(core, 0)
        run_until_idle(core)
    finally:
        core.close()
    assert core.exit_code == 5 and core.status.get("recoveries") == {
        "out_of_memory": 0,
        "gpu_timeout": 0,
    }
    assert "neither out of memory nor a GPU timeout" in core.status.get("error")


def test_with_recovery_off_every_device_failure_restarts(tiny_model, tmp_path):
    core = make_core(
        tiny_model, tmp_path, "resident", "metal_oom_at_eval=6", recover_in_place=False
    )
    try:
        assert core.status.get("device_recovery") == "restart: recover_in_place is off"
        start(core, 0)
        run_until_idle(core)
    finally:
        core.close()
    assert core.exit_code == 5 and core.sink.of(0)[-1]["code"] == ErrorCode.OUT_OF_MEMORY.value


def test_a_request_arriving_during_a_recovery_waits_for_it_and_none_fails(tiny_model, tmp_path):
    expected = uninterrupted(tiny_model, tmp_path, "resident")
    core = make_core(tiny_model, tmp_path / "f", "resident", "metal_oom_at_eval=6")
    try:
        for n in (0, 1):
            start(core, n)
        while not core.in_place.recovering:
            core.step()
        assert core.status.get("state") is DaemonState.RECOVERING
        start(core, 2)  # arrives while the interrupted rows are read again
        steps = 0
        while core.in_place.recovering:
            assert core.status.get("running_requests") == 2  # it waits for the recovery
            core.step()
            steps += 1
        assert steps >= 1 and core.status.get("state") is DaemonState.READY
        run_until_idle(core)
    finally:
        core.close()
    assert {n: core.sink.tokens(n) for n in STREAMS} == expected
    assert core.status.get("requests_failed") == 0


def test_a_real_overcommit_is_refused_on_the_cpu_backend(tiny_model, tmp_path):
    """`overcommit_at_<point>` allocates more than the GPU holds so that MLX's own allocator
    fails (benchmarks/cuda_oom_recovery.py runs it on a CUDA host). On the CPU backend such an
    allocation would swap or be killed rather than fail: a configuration error, before any load."""
    from moed.daemon.engine.loop import Engine
    from moed.daemon.ground.faults import Faults

    assert Faults.parse("overcommit_at_eval=3").overcommits
    assert not Faults.parse("metal_oom_at_eval=3").overcommits
    serve = ServeConfig(
        model=str(tiny_model), state_dir=tmp_path, debug_faults="overcommit_at_eval=3"
    )
    with pytest.raises(ValueError, match="overcommit needs a GPU"):
        Engine(serve, tiny_model, ListSink, EngineStatus())


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_rows_under_a_grammar_continue_under_it_after_a_recovery(tiny_model, tmp_path):
    """A rejoined row's grammar is rebuilt past the tokens it sent (as for `resume_ids`)."""
    fmt = {"type": "json_schema", "schema": SCHEMA}
    rows = [
        {"format": fmt, "max_tokens": 60},
        {"format": fmt, "max_tokens": 60, "temperature": 1.0, "seed": 7},
        {"format": {"type": "json"}, "max_tokens": 60, "temperature": 0.8, "seed": 3},
    ]

    def run(core: EngineCore) -> list[list[int]]:
        for n, row in enumerate(rows):
            submit(core, n, ids(9, n + 2), **row)
        run_until_idle(core)
        assert all(core.sink.of(n)[-1]["type"] == "done" for n in range(len(rows)))
        return [core.sink.tokens(n) for n in range(len(rows))]

    clean = make_core(tiny_model, tmp_path / "clean", "resident")
    try:
        expected = run(clean)
    finally:
        clean.close()
    core = make_core(tiny_model, tmp_path / "f", "resident", "metal_oom_at_eval=12")
    try:
        got = run(core)
    finally:
        core.close()
    assert core.status.get("recoveries")["out_of_memory"] == 1
    assert got == expected and all(len(t) > 12 // len(rows) for t in got)
