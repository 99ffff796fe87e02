"""A fuzz of JSON Schemas through the real gateway and daemon (tests/fixtures/schema_fuzz.py, a
fixed seed): each schema as OpenAI's `response_format`, and as a forced tool call's parameter in
both tool-call formats (mlx-lm's JSON one, Qwen3.6's XML one). Never a 500 and never a failed
engine or request: every answer is a 200 or a typed 400, and every 200 that ended by itself
validates against its schema (formats checked too)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from jsonschema import Draft202012Validator

from tests.fixtures.gateway_harness import start_stack
from tests.fixtures.schema_fuzz import keywords, parameters, schemas
from tests.fixtures.tokenizer import ChatStyle

pytestmark = pytest.mark.process

SEED = 2  # a draw that holds every kind of schema the fuzz is for (COVERS)
COUNT = 24  # schemas, each sent three ways
MAX_TOKENS = 80  # a forced call's markers and keys alone take some 40 tokens of the test tokenizer
PARALLEL = 12  # requests in flight: the daemon batches them
REFUSALS = ("invalid_schema", "invalid_request", "invalid_request_error")
FORMATS = Draft202012Validator.FORMAT_CHECKER
COVERS = {"boolean", "untyped", "oneOf", "anyOf", "allOf", "format", "pattern", "$ref"}


def _stack(tmp, model):
    return start_stack(tmp, model, "--resident", "--max-batch", str(PARALLEL))


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, tiny_model, checkpoint_factory):
    """{format: (daemon, gateway, model name)}: the JSON tool format (and response_format) on the
    ChatML checkpoint, the XML one on the agent checkpoint."""
    agent = checkpoint_factory("qwen3_moe", chat=ChatStyle.AGENT)
    json_stack = _stack(tmp_path_factory.mktemp("fuzz-json"), tiny_model)
    try:
        xml_stack = _stack(tmp_path_factory.mktemp("fuzz-xml"), agent)
    except BaseException:
        json_stack[1].stop()
        json_stack[0].stop()
        raise
    yield {"json": json_stack, "xml": xml_stack}
    for daemon, gateway, _ in (json_stack, xml_stack):
        gateway.stop()
        daemon.stop()


def _requests(stacks) -> list[tuple[str, str, dict, object]]:
    """(target, url, body, the schema the answer must validate against)."""
    out = []
    for n, one in enumerate(schemas(SEED, COUNT)):
        ask = [{"role": "user", "content": f"fuzz {n}"}]
        if isinstance(one, dict):  # response_format takes a schema object
            _, gateway, name = stacks["json"]
            fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": one}}
            body = {"model": name, "messages": ask, "response_format": fmt}
            out.append(("response_format", gateway.url, body, one))
        for target in ("json", "xml"):
            _, gateway, name = stacks[target]
            params = parameters(one)
            tool = {"type": "function", "function": {"name": "t", "parameters": params}}
            body = {
                "model": name,
                "messages": ask,
                "tools": [tool],
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "chat_template_kwargs": {"enable_thinking": False},
            }
            out.append((f"{target} tools", gateway.url, body, params))
    return out


def _check(target: str, url: str, body: dict, schema) -> str:
    """What the answer was ("valid", "cut", "refused"); an AssertionError for anything else."""
    reply = httpx.post(
        f"{url}/v1/chat/completions", json={**body, "max_tokens": MAX_TOKENS}, timeout=300
    )
    what = (target, json.dumps(schema)[:300], reply.text[:600])
    if reply.status_code == 400:
        error = reply.json()["error"]
        assert error["code"] in REFUSALS or error["type"] in REFUSALS, what
        return "refused"
    assert reply.status_code == 200, what
    choice = reply.json()["choices"][0]
    message = choice["message"]
    if choice["finish_reason"] == "length":
        assert "<tool_call>" not in (message.get("content") or ""), what
        return "cut"
    if target == "response_format":
        jsonschema.validate(json.loads(message["content"]), schema, format_checker=FORMATS)
    else:
        assert choice["finish_reason"] == "tool_calls" and not message.get("content"), what
        (call,) = message["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, schema, format_checker=FORMATS)
    return "valid"


def test_random_schemas_are_held_or_refused_never_a_failure(stacks):
    drawn = schemas(SEED, COUNT)
    assert COVERS <= set().union(*map(keywords, drawn))
    requests = _requests(stacks)
    with ThreadPoolExecutor(PARALLEL) as pool:
        outcomes = list(pool.map(lambda r: _check(*r), requests))
    # The fuzz reached the grammars, and most answers ended and were checked.
    assert outcomes.count("valid") >= len(requests) // 2, outcomes
    for daemon, _, _ in stacks.values():
        assert daemon.proc.poll() is None
        with daemon.client() as c:
            status = c.status()
        assert status["state"] != "failed" and status["requests_failed"] == 0, status
