"""The agents and CLIs people point at the gateway, as released on their registries, each finishing
a turn against a real daemon: Claude Code (`claude -p`), Codex CLI (`codex exec`), aider and
OpenCode from the README's own lines (tests/fixtures/readme_agents.py), llm and LiteLLM. `make
test-clients` installs them under $MOED_TEST_CLIENTS (.ci/run does); a client that is not installed
there is skipped with the reason.

The model is the tiny test checkpoint with a 128K context (an agent's prompt and its
`max_tokens: 32000` fit) whose turns end: besides `<|im_end|>`, the tokens it emits most are
end-of-turn ids too (as Llama 3 has several), so a greedy turn ends after a few tokens instead of
running to max_tokens. Its text is gibberish; a finished turn printed without error is the test.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.fixtures.daemon_harness import start_daemon
from tests.fixtures.gateway_harness import start_gateway
from tests.fixtures.readme_agents import agent_lines, opencode_config

pytestmark = pytest.mark.process

CLIENTS = Path(os.environ.get("MOED_TEST_CLIENTS", Path.home() / ".cache/moed/test-clients"))
NPM_BIN = CLIENTS / "npm/node_modules/.bin"
CONTEXT = 131072
SMALL_CONTEXT = 16384  # under Claude Code's 32000 output tokens, over its prompt + 3000 + 1000
CLIENT_TIMEOUT_S = 240
FULL_CLAUDE_CODE_BODY = Path(__file__).parents[1] / "data/claude_code_request.json"


def _client(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path.name} is not installed under {CLIENTS} (run `make test-clients`)")
    return path


def _turn_ending_ids(model_dir: Path, count: int = 12) -> list[int]:
    """The ids the greedy model emits most after its first tokens, on a few chat prompts."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    seen: collections.Counter = collections.Counter()
    first: set[int] = set()
    for text in ("say hi", "Hello!", "What is 2+2?", "Write a haiku"):
        for system in ("", "Answer briefly."):
            turns = [{"role": "system", "content": system}] if system else []
            ids = tokenizer.apply_chat_template(
                [*turns, {"role": "user", "content": text}], add_generation_prompt=True
            )
            out = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=40)]
            first.update(out[:2])
            seen.update(out[2:])
    return [i for i, _ in seen.most_common() if i not in first][:count]


def _agent_model(checkpoint_factory, dest: Path, context: int) -> Path:
    source = checkpoint_factory("qwen3_moe", context=context)
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], *_turn_ending_ids(dest)]
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def agent_model(checkpoint_factory, tmp_path_factory) -> Path:
    return _agent_model(
        checkpoint_factory, tmp_path_factory.mktemp("agent") / "agent_model", CONTEXT
    )


def _stack(tmp: Path, model: Path, context: int):
    daemon = start_daemon(
        tmp / "d", model, "--resident", env={"MOED_MAX_PROMPT_TOKENS": str(context)}
    )
    gateway = None
    try:
        gateway = start_gateway(tmp / "g", daemon.socket)
        yield daemon, gateway, model.name
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop()


@pytest.fixture(scope="module")
def agent_stack(tmp_path_factory, agent_model):
    yield from _stack(tmp_path_factory.mktemp("agents"), agent_model, CONTEXT)


@pytest.fixture(scope="module")
def small_agent_stack(tmp_path_factory, checkpoint_factory):
    """The same kind of model with a context under Claude Code's default 32000 output tokens."""
    tmp = tmp_path_factory.mktemp("small-agents")
    model = _agent_model(checkpoint_factory, tmp / "small_agent_model", SMALL_CONTEXT)
    yield from _stack(tmp, model, SMALL_CONTEXT)


def _run(args: list, tmp: Path, env: dict) -> subprocess.CompletedProcess:
    """A client process with its own home, no stdin and only loopback to talk to."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    node = shutil.which("node")
    path = os.pathsep.join(
        p for p in (str(Path(node).parent) if node else "", "/usr/bin", "/bin") if p
    )
    base = {"PATH": path, "HOME": str(home), "NO_PROXY": "127.0.0.1,localhost", "LANG": "C.UTF-8"}
    return subprocess.run(
        [str(a) for a in args],
        cwd=tmp,
        env={**base, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )


def _answered(gateway, endpoint: str, status: str = "200") -> float:
    """How many requests to `endpoint` the gateway answered `status`, from its own /metrics."""
    text = httpx.get(f"{gateway.url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("moed_gateway_requests_total{")
        and f'endpoint="{endpoint}"' in line
        and f'status="{status}"' in line
    )


CLAUDE_QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
# A prompt of the test's own: Claude Code's long system prompt and 24 tools make 55K tokens in
# this toy tokenizer, minutes to read on a CPU (the whole body is checked in
# test_claude_code_full_request_is_read_and_counted).
CLAUDE_PROMPT = [
    "-p", "say hi", "--output-format", "json", "--tools", "", "--system-prompt", "Answer briefly.",
]  # fmt: skip


def _claude_turn(
    gateway, model: str, context: int, tmp: Path, env: dict, without: tuple[str, ...] = ()
) -> dict:
    """The README's Claude Code line (less the variables `without`) with the test's prompt."""
    claude = _client(NPM_BIN / "claude")
    line = agent_lines(gateway.url, model, context)["claude"]
    given = {k: v for k, v in line.env.items() if k not in without}
    done = _run([claude, *line.args[1:], *CLAUDE_PROMPT], tmp, {**given, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert isinstance(result["result"], str)
    return result


def test_claude_code_finishes_a_turn(agent_stack, tmp_path):
    """The README's line, as written: `claude -p` streams from /v1/messages?beta=true with its real
    request fields (system text blocks with cache_control, thinking adaptive, context_management,
    output_config, metadata) and the max_tokens the line sets."""
    _, gateway, model = agent_stack
    before = _answered(gateway, "/v1/messages")
    result = _claude_turn(
        gateway, model, CONTEXT, tmp_path, {**CLAUDE_QUIET, "CLAUDE_CODE_MAX_RETRIES": "0"}
    )
    assert result["usage"]["input_tokens"] > 0  # message_start carried the prompt's tokens
    assert _answered(gateway, "/v1/messages") > before


def test_claude_code_retries_its_32000_tokens_on_a_smaller_context(small_agent_stack, tmp_path):
    """Without CLAUDE_CODE_MAX_OUTPUT_TOKENS, Claude Code asks for 32000 tokens of a 16384-token
    context: the 400 is worded as it parses (a context overflow), so it retries with the
    max_tokens that fits and finishes the turn."""
    _, gateway, model = small_agent_stack
    refused = _answered(gateway, "/v1/messages", "400")
    without = ("CLAUDE_CODE_MAX_OUTPUT_TOKENS",)
    _claude_turn(gateway, model, SMALL_CONTEXT, tmp_path, CLAUDE_QUIET, without)
    assert _answered(gateway, "/v1/messages", "400") > refused  # it was refused, then retried


def test_claude_code_full_request_is_read_and_counted(agent_stack, gateway_stack):
    """The body Claude Code 2.1.197 sent for `claude -p "say hi"` (recorded, 76 kB: 24 tools, a
    `role: system` entry inside messages, ...) is counted, and over a daemon's prompt limit it is
    Anthropic's 400 in the words Claude Code parses to compact the conversation."""
    body = json.loads(FULL_CLAUDE_CODE_BODY.read_text())
    _, gateway, model = agent_stack
    counted = httpx.post(
        f"{gateway.url}/v1/messages/count_tokens?beta=true", json={**body, "model": model}
    )
    assert counted.status_code == 200, counted.text
    tokens = counted.json()["input_tokens"]
    assert tokens > 512

    small_daemon, small_gateway = gateway_stack  # its prompt limit is 512 tokens
    name = small_daemon.client().connect()["model"]["name"]
    refused = httpx.post(
        f"{small_gateway.url}/v1/messages?beta=true", json={**body, "model": name}, timeout=60
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    found = re.search(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)", error["message"])
    assert found and int(found[2]) == 512 and int(found[1]) > 512


def test_a_context_overflow_is_answered_as_claude_code_retries_it(agent_stack):
    """Prompt + max_tokens over the context: Anthropic's message with the three numbers, from
    which Claude Code retries with the max_tokens that fits."""
    _, gateway, model = agent_stack
    body = {"model": model, "max_tokens": CONTEXT, "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{gateway.url}/v1/messages", json=body)
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    found = re.search(
        r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)", message
    )
    assert found and (int(found[2]), int(found[3])) == (CONTEXT, CONTEXT)


def test_codex_exec_finishes_a_turn(agent_stack, tmp_path):
    """The README's line as `codex exec` over POST /v1/responses (streamed), with its tools
    (functions, a namespace, web_search) and developer messages. Its built-in instructions are
    swapped for a short file and its larger tool sets switched off, for the same reason as
    Claude Code's prompt."""
    codex = _client(NPM_BIN / "codex")
    _, gateway, model = agent_stack
    line = agent_lines(gateway.url, model, CONTEXT)["codex"]
    instructions = tmp_path / "instructions.md"
    instructions.write_text("Answer briefly.\n")
    settings = {
        "model_instructions_file": str(instructions),
        "features.multi_agent": "false",
        "features.goals": "false",
        "features.shell_tool": "false",
        "features.unified_exec": "false",
        "web_search": "disabled",
    }
    flags = [arg for key, value in settings.items() for arg in ("-c", f"{key}={value}")]
    env = {**line.env, "CODEX_HOME": str(tmp_path / "codex")}
    (tmp_path / "codex").mkdir()
    args = [codex, "exec", "--json", "--skip-git-repo-check", *line.args[1:], *flags, "say hi"]
    before = _answered(gateway, "/v1/responses")
    done = _run(args, tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, kinds
    assert _answered(gateway, "/v1/responses") > before


def test_llm_finishes_a_turn(agent_stack, tmp_path):
    """Simon Willison's `llm` with the gateway as an extra OpenAI model; at the daemon's greedy
    default its text equals the chat completion of the same prompt."""
    llm = _client(CLIENTS / "py-llm/bin/llm")
    _, gateway, model = agent_stack
    user_path = tmp_path / "llm"
    user_path.mkdir()
    (user_path / "extra-openai-models.yaml").write_text(
        f"- model_id: moed\n  model_name: {model}\n  api_base: {gateway.url}/v1\n"
    )
    done = _run(
        [llm, "-m", "moed", "--no-log", "say hi"], tmp_path, {"LLM_USER_PATH": str(user_path)}
    )
    assert done.returncode == 0, done.stderr
    expected = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "say hi"}]},
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert done.stdout.rstrip("\n") == expected.rstrip("\n")


LITELLM_SCRIPT = """
import json, sys
import litellm
url, model = sys.argv[1], sys.argv[2]
chat = litellm.completion(model="openai/" + model, api_base=url + "/v1", api_key="unused",
                          messages=[{"role": "user", "content": "say hi"}], max_tokens=16)
info = litellm.get_model_info("ollama_chat/" + model, custom_llm_provider=None)
print(json.dumps({"text": chat.choices[0].message.content,
                  "finish": chat.choices[0].finish_reason,
                  "context": info.get("max_input_tokens")}))
"""


def test_litellm_finishes_a_turn_and_reads_the_context(agent_stack, tmp_path):
    python = _client(CLIENTS / "py-litellm/bin/python")
    _, gateway, model = agent_stack
    env = {"OLLAMA_API_BASE": gateway.url, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    done = _run([python, "-c", LITELLM_SCRIPT, gateway.url, model], tmp_path, env)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(answer["text"], str) and answer["finish"] in ("stop", "length")
    assert answer["context"] == CONTEXT  # from /api/show's model_info


def test_aider_finishes_a_turn(agent_stack, tmp_path):
    """aider through Ollama's API, where it reads the model's context window from /api/show."""
    aider = _client(CLIENTS / "py-aider-chat/bin/aider")
    _, gateway, model = agent_stack
    line = agent_lines(gateway.url, model, CONTEXT)["aider"]
    before = _answered(gateway, "/api/chat")
    args = [
        aider,
        *line.args[1:],
        "--message",
        "say hi",
        "--yes-always",
        "--no-git",
        "--no-check-update",
        "--no-show-model-warnings",
        "--no-pretty",
        "--no-fancy-input",
        "--analytics-disable",
        "--map-tokens",
        "0",
    ]
    env = {**line.env, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    done = _run(args, tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Tokens:" in done.stdout, done.stdout  # aider's report of a finished exchange
    assert _answered(gateway, "/api/chat") > before


def test_opencode_finishes_a_turn(agent_stack, tmp_path):
    """`opencode run` with the README's opencode.json (the AI SDK's @ai-sdk/openai-compatible,
    which OpenCode installs from npm on first use, and the model's `limit`); its build agent's
    prompt is swapped for a short one and its tools switched off, as for Claude Code."""
    opencode = _client(NPM_BIN / "opencode")
    _, gateway, model = agent_stack
    config = {
        **opencode_config(gateway.url, model, CONTEXT),
        "autoupdate": False,
        "share": "disabled",
        "agent": {"build": {"prompt": "Answer briefly.", "tools": {"*": False}}},
    }
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    env = {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "true"}
    before = _answered(gateway, "/v1/chat/completions")
    done = _run([opencode, "run", "--print-logs", "say hi"], tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "error" not in done.stdout.lower(), done.stdout
    assert _answered(gateway, "/v1/chat/completions") > before
