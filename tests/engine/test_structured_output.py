"""Structured output by constrained decoding (llguidance): every greedy and seeded answer under a
schema parses and validates, in a batch of schema and plain rows, at any cache budget; a plain
row's tokens are those of the same request alone; a schema that cannot compile is a typed error
and the daemon goes on serving."""

from __future__ import annotations

import json

import httpx
import pytest

from moed.client import RequestFailed, TokenEvent
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import run_together

# Bounded (string lengths, integer range, enum items, no free whitespace): every answer ends
# within MAX_TOKENS, so each one must be complete JSON.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "schema": SCHEMA}
MAX_TOKENS = 160
WINDOW_MS = "1500"  # an idle daemon gathers the requests into one batch


def valid(value) -> bool:
    """The checks SCHEMA asks for, one by one."""
    if not isinstance(value, dict) or not {"name", "age", "admin"} <= value.keys():
        return False
    if not value.keys() <= SCHEMA["properties"].keys():
        return False
    tags = value.get("tags", [])
    return (
        isinstance(value["name"], str)
        and len(value["name"]) <= 10
        and isinstance(value["age"], int)
        and not isinstance(value["age"], bool)
        and 0 <= value["age"] <= 150
        and isinstance(value["admin"], bool)
        and isinstance(tags, list)
        and len(tags) <= 3
        and all(t in ("red", "green", "blue") for t in tags)
    )


def chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


SEEDED = {"temperature": 1.0, "seed": 7}
BATCH = [
    chat("Alice as JSON", format=FORMAT),
    chat("a story"),
    chat("Bob as JSON", format=FORMAT, **SEEDED),
    chat("another story", temperature=0.9, seed=3),
    chat("Carol as JSON", format={"type": "json"}, **SEEDED),
    chat("Dave as JSON", format=FORMAT, temperature=1.5, top_p=0.95, seed=11),
]


def answer_text(daemon, request: dict) -> tuple[str, list[int], str]:
    with daemon.client() as c:
        parts, ids, finish = [], [], None
        for event in c.generate(max_tokens=MAX_TOKENS, **request):
            if isinstance(event, TokenEvent):
                ids += event.ids
                parts.append(event.text)
            else:
                finish = getattr(event, "finish_reason", finish)
    return "".join(parts), ids, finish


@pytest.mark.process
def test_schema_rows_always_validate_and_plain_rows_are_untouched(daemon_factory, tiny_model):
    # The smallest expert cache ("1" byte: multi-pass reads) against the resident model.
    budget = "1"
    alone = daemon_factory(tiny_model, "--resident")
    plain_alone = {n: answer_text(alone, BATCH[n])[1] for n in (1, 3)}
    alone.stop()
    d = daemon_factory(
        tiny_model, "--max-batch", "6", "--batch-window-ms", WINDOW_MS, "--cache-budget", budget
    )
    results = run_together(d, BATCH, max_tokens=MAX_TOKENS)
    with d.client() as c:
        assert c.status()["peak_running_requests"] == len(BATCH)  # really one batch
    detok = _Detok(d)
    for n, (request, (ids, done)) in enumerate(zip(BATCH, results, strict=True)):
        assert not isinstance(done, RequestFailed), done
        if "format" not in request:
            assert ids == plain_alone[n], n  # a mask on other rows changes nothing here
            continue
        text = detok.text(ids)
        if request["format"]["type"] == "json":
            # Any object: unbounded, so it may run to max_tokens; what came is an object's start.
            assert text.startswith("{")
            if done.finish_reason == "stop":
                assert isinstance(json.loads(text), dict)
            continue
        assert done.finish_reason == "stop", (n, done.finish_reason)  # the grammar ended it
        assert valid(json.loads(text)), text


class _Detok:
    """The answer text of token ids, as the model's tokenizer decodes them."""

    def __init__(self, daemon):
        from mlx_lm.utils import load_tokenizer

        with daemon.client() as c:
            path = c.welcome["model"]["path"]
        self.tok = load_tokenizer(path)

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


@pytest.mark.process
def test_a_schema_that_cannot_compile_is_a_typed_error(daemon_factory, tiny_model):
    d = daemon_factory(tiny_model, "--resident")
    with d.client() as c:
        bad = {
            "type": "json_schema",
            "schema": {"type": "object", "properties": {"a": {"type": "frob"}}},
        }
        with pytest.raises(RequestFailed) as failed:
            list(c.generate(**chat("x", format=bad), max_tokens=8))
        assert failed.value.code == ErrorCode.INVALID_SCHEMA
        assert "frob" in failed.value.message
        with pytest.raises(RequestFailed) as refused:  # not a schema at all: at the edge
            list(c.generate(**chat("x", format={"type": "yaml"}), max_tokens=8))
        assert refused.value.code == ErrorCode.INVALID_REQUEST
        text, ids, finish = answer_text(d, chat("still serving"))
        assert ids and finish in ("stop", "length")


# ---- through the gateway: each API's own control ---------------------------------------------
@pytest.fixture(scope="module")
def stack(gateway_stack):
    daemon, gateway = gateway_stack
    with daemon.client() as c:
        return gateway, c.welcome["model"]["name"]


@pytest.mark.process
def test_openai_response_format_json_schema_with_the_sdk(stack):
    import openai

    gateway, model = stack
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "a user"}],
            response_format=fmt,
            max_tokens=MAX_TOKENS,
            **sampling,
        )
        assert reply.choices[0].finish_reason == "stop"
        assert valid(json.loads(reply.choices[0].message.content))
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "a user"}],
        response_format=fmt,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    assert valid(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)))
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], response_format=bad
        )
    assert "frob" in str(refused.value)


@pytest.mark.process
def test_ollama_format_schema_and_json(stack):
    gateway, model = stack
    url = f"{gateway.url}/api/chat"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "a user"}],
        "stream": False,
        "options": {"num_predict": MAX_TOKENS, "seed": 2, "temperature": 0.8},
    }
    reply = httpx.post(url, json={**body, "format": SCHEMA}, timeout=60).json()
    assert reply["done_reason"] == "stop" and valid(json.loads(reply["message"]["content"]))
    anything = httpx.post(url, json={**body, "format": "json"}, timeout=60).json()
    assert anything["message"]["content"].startswith("{")
    refused = httpx.post(url, json={**body, "format": "yaml"}, timeout=60)
    assert refused.status_code == 400 and "format" in refused.json()["error"]


def test_a_failed_matcher_ends_the_answer_instead_of_freeing_it(tmp_path):
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from moed.daemon.engine.grammar import GrammarConstraint, grammar_for, ll_tokenizer
    from moed.daemon.engine.grammar_compile import GrammarLimits, compile_matcher
    from moed.protocol import GenerateRequest, ResponseFormat
    from moed.protocol.constraints import FormatType
    from tests.fixtures.tokenizer import write_tokenizer

    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    tok = load_tokenizer(tmp_path)
    asks = GenerateRequest(prompt="x", format=ResponseFormat(FormatType.JSON))
    limits = GrammarLimits(workers=1, max_source_bytes=1 << 20, timeout_s=10.0)
    matcher = compile_matcher(ll_tokenizer(tok), grammar_for(asks, tok), limits)
    mask = GrammarConstraint(tok, matcher, False, [])
    width = len(tok)
    first = mask(mx.array([1]), mx.zeros((1, width)))
    allowed = [i for i in range(width) if first[0, i].item() > -1e30]
    assert allowed and all(tok.decode([i]).startswith("{") for i in allowed)
    refused = next(i for i in range(width) if i not in allowed and i not in tok.eos_token_ids)
    # A token outside the mask (as if sampled anyway): from then on only the end of sequence.
    after = mask(mx.array([1, refused]), mx.zeros((1, width)))
    assert mask.failed
    assert [i for i in range(width) if after[0, i].item() > -1e30] == sorted(tok.eos_token_ids)


def test_a_request_without_a_grammar_never_imports_llguidance(tmp_path):
    """A recovery's rejoin asks every row for its grammar; a plain row must not need llguidance
    (a CUDA host without it failed its in-place recovery on that import)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['llguidance'] = None\n"  # any import of it now raises ImportError
        "from moed.daemon.engine.grammar import grammar_for\n"
        "from moed.protocol import GenerateRequest\n"
        "assert grammar_for(GenerateRequest(prompt='x'), None) is None\n"
        "try:\n"
        "    from moed.protocol import ResponseFormat\n"
        "    from moed.protocol.constraints import FormatType\n"
        "    asks = GenerateRequest(prompt='x', format=ResponseFormat(FormatType.JSON))\n"
        "    grammar_for(asks, None)\n"
        "except ImportError:\n"
        "    print('needs llguidance only for a format')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "needs llguidance only for a format"
