"""runtime/start_plan.py: the plan the transport serves is final (the budget backed off after a
memory crash), and the cache budget is parsed once, at the configuration, on its way to experts/."""

from __future__ import annotations

from moed.daemon.config import ServeConfig, load_config
from moed.daemon.experts.budget import BudgetKind, CacheBudget
from moed.daemon.experts.memory_plan import plan_memory
from moed.daemon.experts.streaming_config import StreamingConfig
from moed.daemon.ground.crashlog import CrashKind, record_crash
from moed.daemon.model.loader import streaming_config
from moed.daemon.runtime.start_plan import plan_start
from moed.protocol.model_config import ModelConfig


def _no_second_parse(monkeypatch):
    def refuse(spec):
        raise AssertionError(f"the cache budget {spec!r} was parsed again")

    monkeypatch.setattr(CacheBudget, "parse", staticmethod(refuse))


def test_the_flag_is_parsed_once_into_the_budget_the_memory_plan_resolves(
    tiny_model, tmp_path, monkeypatch
):
    serve = load_config(None, serve_overrides={"cache_budget": "25%", "state_dir": tmp_path}).serve
    assert serve.cache_budget == CacheBudget(BudgetKind.FRACTION, 0.25, "25%")
    from_text = plan_memory(tiny_model, StreamingConfig(cache_budget="25%"))
    _no_second_parse(monkeypatch)  # from here on: resolved, never parsed
    plan = plan_start(serve, tiny_model)
    assert plan.serve.cache_budget is serve.cache_budget and plan.budget_backoff is None
    cfg = streaming_config(plan.serve, ModelConfig.from_dict({}))
    assert cfg.cache_budget is serve.cache_budget
    memory = plan_memory(tiny_model, cfg)
    assert 0 < memory.cache_budget_bytes == from_text.cache_budget_bytes < memory.experts_bytes


def test_after_a_memory_crash_the_plan_carries_the_backed_off_budget_in_bytes(
    tiny_model, tmp_path, monkeypatch
):
    serve = ServeConfig(state_dir=tmp_path, cache_budget="50%", restart_budget=5)
    full = plan_memory(
        tiny_model, streaming_config(serve, ModelConfig.from_dict({}))
    ).cache_budget_bytes
    record_crash(tmp_path, CrashKind.OUT_OF_MEMORY, "oom", "boot-1")
    _no_second_parse(monkeypatch)
    plan = plan_start(serve, tiny_model)
    assert plan.crashes.budget_factor == 0.5 and plan.crashes.refuse is None
    assert plan.serve.cache_budget.kind is BudgetKind.BYTES
    assert plan.budget_backoff["budget_bytes_full"] == full
    assert plan.serve.cache_budget.resolve(0) == plan.budget_backoff["budget_bytes"] < full
    assert serve.cache_budget.text == "50%"  # the configuration itself is untouched (frozen)
