"""The engine core in-process, with no socket: commands in, events out, tokens as mlx-lm's."""

from __future__ import annotations

import pytest

from moed.daemon.config import ServeConfig
from moed.daemon.engine.commands import Cancel, Shed, Submit
from moed.daemon.engine.core import EngineCore
from moed.daemon.engine.request import GenerateJob
from moed.daemon.engine.scheduler import BatchLimits, FairBatchScheduler
from moed.daemon.engine.status import DaemonState, EngineStatus
from moed.protocol import MessageType, ShedLevel, validate_generate
from moed.protocol import messages as wire
from tests.fixtures.engine_driver import ListSink, run_until_idle
from tests.fixtures.reference import generate

PROMPT_IDS = [5, 17, 33, 2, 41]


def generate_job(identity: bytes, req_id, **fields) -> GenerateJob:
    msg = wire.request(MessageType.GENERATE, req_id, prompt_ids=PROMPT_IDS, **fields)
    return GenerateJob(identity, req_id, validate_generate(msg))  # as the transport submits


@pytest.fixture(params=["resident", "streaming"])
def core(request, tiny_model, tmp_path):
    resident = request.param == "resident"
    serve = ServeConfig(
        model=str(tiny_model), state_dir=tmp_path, resident=resident, cache_budget="25%"
    )
    status = EngineStatus()
    engine = EngineCore(serve, tiny_model, ListSink(), status)
    assert engine.load()
    yield engine
    engine.close()


def test_core_tokens_equal_mlx_lm_and_status_is_typed(core, tiny_model):
    core.handle(Submit(generate_job(b"a", 1, max_tokens=8)))
    assert core.status.get("active_requests") == 1 and core.status.get("busy") is True
    run_until_idle(core)
    assert core.sink.tokens(1) == generate(tiny_model, PROMPT_IDS, 8)
    done = core.sink.of(1)[-1]
    assert done["type"] == "done" and done["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    snap = core.status.snapshot()
    assert snap["state"] == DaemonState.READY.value and snap["active_requests"] == 0
    assert snap["tokens_generated"] == len(core.sink.tokens(1)) and snap["requests_served"] == 1
    with pytest.raises(AttributeError):
        core.status.update(not_a_status_field=1)


def test_rows_of_unequal_length_decode_as_alone_masked_only_while_padded(tiny_model, tmp_path):
    """Two prompts of unequal length decode as one batch (the shorter row is left-padded: each
    step is masked); once the short one ends, the other decodes unpadded, with no mask. Each gets
    the tokens it gets alone."""
    from mlx_lm.models.cache import BatchKVCache

    from moed.daemon.engine.decode_mask import UnpaddedBatchKVCache

    serve = ServeConfig(model=str(tiny_model), state_dir=tmp_path, resident=True)
    core = EngineCore(serve, tiny_model, ListSink(), EngineStatus())
    assert core.load()
    long_ids = [(11 * i) % 200 + 3 for i in range(17)]
    core.handle(Submit(generate_job(b"a", 1, max_tokens=6)))
    msg = wire.request(MessageType.GENERATE, 2, prompt_ids=long_ids, max_tokens=24)
    core.handle(Submit(GenerateJob(b"b", 2, validate_generate(msg))))
    kinds = set()
    while core.has_work:
        core.step()
        layers = core.batch._gen._generation_batch.prompt_cache
        kinds.add((core.status.get("running_requests"), type(layers[0]) if layers else None))
    core.close()
    assert (2, BatchKVCache) in kinds  # both rows, one padded: masked
    assert (1, UnpaddedBatchKVCache) in kinds  # alone: no mask
    assert core.sink.tokens(1) == generate(tiny_model, PROMPT_IDS, 6)
    assert core.sink.tokens(2) == generate(tiny_model, long_ids, 24)


def token_events(core, who: bytes) -> list[dict]:
    return [m for i, m, _ in core.sink.events if i == who and m["type"] == "token" and m["ids"]]


def test_core_batches_two_clients_and_cancels_within_a_step(core):
    core.handle(Submit(generate_job(b"a", "x", max_tokens=6)))
    core.handle(Submit(generate_job(b"b", "x", max_tokens=6)))
    # The first token goes out in the step its prompt ends, the second two steps later (the
    # generator's own step for the first hands out nothing new): then one a step.
    while len(token_events(core, b"a")) < 2 or len(token_events(core, b"b")) < 2:
        core.step()
    # Both rows joined the same batch: every step gives each its next token.
    assert core.status.get("running_requests") == 2
    for _ in range(2):
        before = (len(token_events(core, b"a")), len(token_events(core, b"b")))
        core.step()
        after = (len(token_events(core, b"a")), len(token_events(core, b"b")))
        assert after == (before[0] + 1, before[1] + 1)
    sent = len(token_events(core, b"a"))
    core.handle(Cancel((b"a", "x")))
    ends = [(i, m) for i, m, terminal in core.sink.events if terminal]
    assert [(i, m["finish_reason"]) for i, m in ends] == [(b"a", "cancelled")]
    run_until_idle(core)
    assert len(token_events(core, b"a")) == sent  # no token of `a` after its cancel
    assert len(token_events(core, b"b")) == 6


def test_core_long_prompt_prefills_in_chunks_between_decode_steps(tiny_model, tmp_path):
    """A prompt of many chunks arrives while a stream decodes: the stream gets a token per chunk."""
    chunk, prompt_len = 32, 32 * 6
    serve = ServeConfig(
        model=str(tiny_model), state_dir=tmp_path, resident=True, prefill_chunk=chunk
    )
    core = EngineCore(serve, tiny_model, ListSink(), EngineStatus())
    assert core.load()
    core.handle(Submit(generate_job(b"a", 1, max_tokens=100)))
    while not token_events(core, b"a"):
        core.step()
    long_ids = [(7 * i) % 200 + 3 for i in range(prompt_len)]
    msg = wire.request(MessageType.GENERATE, 2, prompt_ids=long_ids, max_tokens=2)
    core.handle(Submit(GenerateJob(b"b", 2, validate_generate(msg))))
    during = 0
    while not token_events(core, b"b"):
        before = len(token_events(core, b"a"))
        core.step()
        during += len(token_events(core, b"a")) > before
    # One decode token per step while the prompt is read chunk by chunk (the last token of the
    # prompt is read in the first decode step of its row, not in a chunk).
    assert during >= prompt_len // chunk
    run_until_idle(core)
    core.close()


def test_core_shed_cancel_newest_fails_only_the_newest(core):
    core.handle(Submit(generate_job(b"a", 1, max_tokens=4)))
    core.handle(Submit(generate_job(b"a", 2, max_tokens=4)))
    core.step()
    core.handle(Shed(ShedLevel.CANCEL_NEWEST))
    assert core.sink.of(2)[-1]["code"] == "out_of_memory"
    snap = core.status.snapshot()
    assert snap["sheds"] == 1 and snap["last_shed"]["cancelled"] == 2
    run_until_idle(core)
    assert core.sink.of(1)[-1]["type"] == "done"


def test_scheduler_admits_clients_in_turn_within_max_batch():
    sched = FairBatchScheduler(BatchLimits(max_batch=3, kv_tokens=10_000))
    for n in range(4):  # one client floods first
        sched.add((b"flood", n), b"flood", 10)
    sched.add((b"other", 0), b"other", 10)
    sched.add((b"third", 0), b"third", 10)
    assert sched.schedule().admit == ((b"flood", 0), (b"other", 0), (b"third", 0))
    assert sched.schedule().admit == ()  # the batch is full
    sched.remove((b"other", 0))
    assert sched.schedule().admit == ((b"flood", 1),)
    assert sched.running == 3 and len(sched) == 5 and sched.newest() == (b"third", 0)


def test_scheduler_keeps_the_batch_kv_within_the_plan():
    # The batched cache pads rows to the longest: 3 rows of up to 400 tokens need 1200.
    sched = FairBatchScheduler(BatchLimits(max_batch=8, kv_tokens=1000))
    sched.add((b"a", 0), b"a", 400)
    sched.add((b"b", 0), b"b", 400)
    sched.add((b"c", 0), b"c", 400)
    assert sched.schedule().admit == ((b"a", 0), (b"b", 0))
    sched.remove((b"a", 0))
    assert sched.schedule().admit == ((b"c", 0),)
    # A request larger than the whole plan still runs alone.
    sched.remove((b"b", 0))
    sched.remove((b"c", 0))
    sched.add((b"d", 0), b"d", 5000)
    assert sched.schedule().admit == ((b"d", 0),)


def test_a_prompt_step_of_cancelled_rows_stops_and_the_next_request_is_served(core, tiny_model):
    """Every row of the batch cancelled (the transport posts the key before the engine sees the
    Cancel command): the prompt step stops at its first layer, the row ends cancelled with no
    token, and a new batch serves the next request as mlx-lm would."""
    long_ids = [(13 * i) % 200 + 3 for i in range(40)]
    msg = wire.request(MessageType.GENERATE, 1, prompt_ids=long_ids, max_tokens=8)
    job = GenerateJob(b"a", 1, validate_generate(msg))
    core.handle(Submit(job))
    core.cancels.post(job.key)  # as Engine.cancel does, ahead of its Cancel command
    run_until_idle(core)
    done = core.sink.of(1)[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert core.sink.tokens(1) == [] and not core.has_work
    core.handle(Cancel(job.key))  # arrives after the row ended: ignored, and the key let go
    assert not core.cancels
    core.handle(Submit(generate_job(b"b", 2, max_tokens=6)))
    run_until_idle(core)
    assert core.sink.tokens(2) == generate(tiny_model, PROMPT_IDS, 6)


def test_a_cancelled_prompt_beside_a_live_row_does_not_stop_the_step(core, tiny_model):
    """One row cancelled, another decoding: the step runs on (the live row's state is in it);
    the cancel ends the row at the step's end, and the live row's tokens are mlx-lm's."""
    core.handle(Submit(generate_job(b"a", 1, max_tokens=120)))  # still decoding at row 2's token
    while not core.sink.tokens(1):
        core.step()
    long_ids = [(13 * i) % 200 + 3 for i in range(40)]
    msg = wire.request(MessageType.GENERATE, 2, prompt_ids=long_ids, max_tokens=8)
    job = GenerateJob(b"b", 2, validate_generate(msg))
    core.handle(Submit(job))
    core.cancels.post(job.key)
    for _ in range(100):  # row 2's prompt is read beside row 1's decode, not stopped
        if core.sink.tokens(2):
            break
        core.step()
    assert core.sink.tokens(2) and core.sink.of(2)[-1]["type"] != "done"
    assert core.sink.of(1)[-1]["type"] != "done"  # row 2 read its prompt beside a live row
    core.handle(Cancel(job.key))
    assert core.sink.of(2)[-1]["finish_reason"] == "cancelled"
    run_until_idle(core)
    assert core.sink.tokens(1) == generate(tiny_model, PROMPT_IDS, 120)
