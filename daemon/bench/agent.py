"""`moed bench agent`: growing agent conversations (a long system prompt, then turns that each send
the whole history again) through `moed gateway`, resident and at a streaming budget, beside
mlx_lm.server (its own prompt cache) started on the same checkpoint; then each conversation
continued after a daemon restart. Time to first token per turn, tokens reused, expert bytes read
per prompt token read, and the issue's ratios, measured in one run: several conversations (other
text, the same shape) per side, medians, so one disturbed turn on a shared machine moves nothing.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from moed.client import Client
from moed.client.autostart import start_daemon, wait_until_ready
from moed.daemon.bench.agent_bound import measure_bound
from moed.daemon.bench.agent_report import print_report
from moed.daemon.bench.gateway_timing import start_gateway
from moed.daemon.model.source import resolve_model


@dataclass(frozen=True)
class Conversation:
    system: str  # the long system prompt (tool definitions in a real agent)
    users: tuple[str, ...]  # one user message per turn, the last one for the turn after a restart
    max_tokens: int
    warm_up: str = ""  # unrelated text of about a turn's new tokens (a restarted daemon's first)


@dataclass
class TurnResult:
    ttft_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    read_bytes: int | None = None  # expert bytes the daemon read for this turn (streaming)
    # ... of them by the first token (read when it arrives: a decode step already under way
    # may add a little); what the time to first token waits for
    first_read_bytes: int | None = None


@dataclass
class Run:
    """One conversation on one side."""

    turns: list[TurnResult] = field(default_factory=list)
    new_only: TurnResult | None = None  # only the last turn's new text, alone
    restarted: TurnResult | None = None  # the next turn, the first after a daemon restart
    last_prompt: str = ""  # the last turn's prompt and its new text (for the model's bound)
    new_text: str = ""


@dataclass
class SideResult:
    name: str
    runs: list[Run] = field(default_factory=list)
    # mlx_lm.server's turns of the same conversations, each sent right beside this side's turn
    # (the order alternating), so that both see the same load
    beside: list[Run] = field(default_factory=list)


def make_conversation(
    tokenizer, system_tokens: int, turns: int, user_tokens: int, max_tokens: int, seed: int
) -> Conversation:
    """Text decoded from seeded token ids (no special tokens), so any tokenizer has words."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(min(tokenizer.vocab_size, 32000)) if i not in special]

    def text(n: int) -> str:
        return tokenizer.decode([rng.choice(vocab) for _ in range(n)])

    users = tuple(f"\nUser: {text(user_tokens)}\nAssistant:" for _ in range(turns + 1))
    system = text(system_tokens)
    return Conversation(system, users, max_tokens, text(user_tokens + max_tokens))


@dataclass(frozen=True)
class Completion:
    ttft_s: float
    text: str
    usage: dict
    at_first: int | None  # what `at_first` answered when the first text came


def stream_completion(
    http, url: str, model: str | None, prompt: str, max_tokens: int, at_first=None
) -> Completion:
    """One streamed /v1/completions call, `at_first()` asked as its first text arrives."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if model is not None:
        body["model"] = model
    t0 = time.perf_counter()
    first, parts, usage, mark = None, [], None, None
    with http.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:  # e.g. 413: the conversation outgrew the model's context
            raise click.ClickException(
                f"{url} answered {resp.status_code}: {resp.read().decode(errors='replace')[:500]}"
                " (a shorter --system-tokens, fewer --turns or --user-tokens fit)"
            )
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    if first is None:
                        first = time.perf_counter()
                        mark = at_first() if at_first else None
                    parts.append(choice["text"])
    return Completion((first or time.perf_counter()) - t0, "".join(parts), usage or {}, mark)


def converse(
    http, url, model, conv: Conversation, turns: int, read_bytes=None, peer: str | None = None
) -> tuple:
    """`turns` turns, each sending the whole history: the results, each turn's prompt, the
    history after the last answer, and the `peer` server's results of the same conversation (its
    own history), each turn sent right before or after ours, alternately."""
    history, results, prompts = conv.system, [], []
    peer_history = conv.system
    peer_results: list[TurnResult] = []
    for k in range(turns):
        prompt = history + conv.users[k]
        if peer is not None and k % 2:
            peer_history = _peer_turn(http, peer, conv, k, peer_history, peer_results)
        result, answer = timed_turn(http, url, model, prompt, conv.max_tokens, read_bytes)
        if peer is not None and not k % 2:
            peer_history = _peer_turn(http, peer, conv, k, peer_history, peer_results)
        results.append(result)
        prompts.append(prompt)
        history = prompt + answer
    return results, prompts, history, peer_results


def _peer_turn(http, url: str, conv: Conversation, k: int, history: str, out: list) -> str:
    prompt = history + conv.users[k]
    result, answer = timed_turn(http, url, None, prompt, conv.max_tokens)
    out.append(result)
    return prompt + answer


def timed_turn(
    http, url, model, prompt: str, max_tokens: int, read_bytes=None
) -> tuple[TurnResult, str]:
    """One turn and its answer, with the expert bytes it read (by its first token and in all)
    when `read_bytes` (the daemon's counter) is given."""
    before = read_bytes() if read_bytes else None
    done = stream_completion(http, url, model, prompt, max_tokens, read_bytes)
    details = done.usage.get("prompt_tokens_details") or {}
    result = TurnResult(done.ttft_s, done.usage.get("prompt_tokens"), details.get("cached_tokens"))
    if before is not None:
        result.read_bytes = read_bytes() - before
        result.first_read_bytes = done.at_first - before if done.at_first is not None else None
    return result, done.text


class MoedSide:
    """A daemon (own state dir, so its SSD tier survives its restart) and a gateway before it."""

    def __init__(self, name: str, model: Path, run_dir: Path, args: tuple[str, ...]):
        self.name, self.model, self.args = name, model, args
        self.dir = run_dir / name.replace("%", "pct")
        self.socket = run_dir / f"{len(name)}-{abs(hash(name)) % 10**6}.sock"
        self.daemon: subprocess.Popen[bytes] | None = None
        self.gateway: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        state = ("--state-dir", str(self.dir / "state"), "--log-level", "WARNING")
        self.daemon = start_daemon(
            self.socket, str(self.model), (*state, *self.args), env={"MOED_LOG_DIR": str(self.dir)}
        )
        wait_until_ready(self.socket, self.daemon, 300)
        self.gateway, self.url = start_gateway(self.socket, self.dir / "gateway.log")

    def read_bytes(self) -> int:
        """Expert bytes read, on demand and ahead of their call."""
        with Client(self.socket, timeout=10.0) as c:
            ex = c.stats().get("experts") or {}
            return int(ex.get("bytes_read") or 0) + int(ex.get("prefetch_bytes") or 0)

    def stop(self) -> None:
        for proc in (self.gateway, self.daemon):
            if proc is None or proc.poll() is not None:
                continue
            try:
                if proc is self.daemon:
                    with Client(self.socket, timeout=10.0) as c:
                        c.shutdown("bench agent")  # a clean drain: the SSD writes land
                else:
                    proc.terminate()
                proc.wait(60)
            except Exception:
                proc.kill()
                proc.wait(10)


def start_mlx_lm_server(model: Path, log_path: Path, prefill_chunk: int):
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)]
    cmd += ["--prefill-step-size", str(prefill_chunk), "--log-level", "WARNING"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"mlx_lm.server exited: {log_path.read_text()[-2000:]}")
        try:
            httpx.get(f"{url}/v1/models", timeout=1.0)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise click.ClickException("mlx_lm.server did not answer within 300s")


def run_moed_side(
    http, side: MoedSide, convs: list[Conversation], turns: int, streaming: bool, peer=None
):
    """Every conversation on one daemon (and turn by turn beside it on the `peer` server), each
    with its last turn's new text alone; then, for each, a daemon restart and that conversation's
    next turn."""
    result = SideResult(side.name)
    side.start()
    try:
        model = http.get(f"{side.url}/v1/models").json()["data"][0]["id"]
        reads = side.read_bytes if streaming else None
        histories = []
        for conv in convs:
            run = Run()
            run.turns, prompts, history, beside = converse(
                http, side.url, model, conv, turns, reads, peer
            )
            if peer is not None:
                result.beside.append(Run(beside))
            # The last turn's new text alone (the answer before it and its user message): what
            # the prefix cache leaves that turn to read, with nothing before it; the same path,
            # the same daemon, right after that turn.
            run.last_prompt = prompts[-1]
            run.new_text = prompts[-1][len(prompts[-2]) :] if turns > 1 else prompts[-1]
            run.new_only = timed_turn(http, side.url, model, run.new_text, conv.max_tokens, reads)[
                0
            ]
            result.runs.append(run)
            histories.append(history)
        for conv, run, history in zip(convs, result.runs, histories):
            side.stop()
            side.start()  # a new daemon process: its memory tier is empty, the SSD tier is not
            # The model warmed, not the cache: unrelated text as long as a turn's new tokens and
            # two tokens out, so a new process's one-time costs (first kernels, allocations, the
            # gateway's first connection) are not counted as the prefix cache's.
            stream_completion(http, side.url, model, conv.warm_up, 2)
            prompt = history + conv.users[turns]
            run.restarted = timed_turn(http, side.url, model, prompt, conv.max_tokens, reads)[0]
    finally:
        side.stop()
    return result


@click.command("agent")
@click.option("--model", default="demo", show_default=True, help="Checkpoint folder, Hub id, demo.")
@click.option("--system-tokens", default=1500, show_default=True, help="System prompt length.")
@click.option("--turns", default=6, show_default=True, help="Turns, each re-sending the history.")
@click.option("--user-tokens", default=60, show_default=True, help="Tokens per user message.")
@click.option("--max-tokens", default=16, show_default=True, help="Tokens generated per turn.")
@click.option("--budget", default="25%", show_default=True, help="The streaming side's budget.")
@click.option("--prefill-chunk", default=256, show_default=True, help="Both servers' chunk.")
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1),
    help="Conversations per side (other text, one restart each); the report shows medians.",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the first conversation's text.")
@click.option(
    "--no-mlx-lm",
    is_flag=True,
    help="Skip the mlx_lm.server column and the plain mlx-lm floor (both hold the whole model).",
)
@click.option(
    "--pipeline",
    "ranks",
    default=1,
    show_default=True,
    type=click.IntRange(1, 8),
    help="Both moed sides as a pipeline of this many local ranks (each keeps its own layers' "
    "cache, in memory and on the SSD).",
)
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Also write JSON here.")
def bench_agent(
    model,
    system_tokens,
    turns,
    user_tokens,
    max_tokens,
    budget,
    prefill_chunk,
    repeats,
    seed,
    no_mlx_lm,
    ranks,
    json_out,
) -> None:
    """Growing agent conversations through the gateway, resident and streaming, beside
    mlx_lm.server; each continued after a daemon restart. TTFT per turn (medians) and the
    ratios."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import httpx
    from mlx_lm.utils import load_tokenizer

    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    convs = [
        make_conversation(tokenizer, system_tokens, turns, user_tokens, max_tokens, seed + k)
        for k in range(repeats)
    ]
    run_dir = Path(tempfile.mkdtemp(prefix="moed-bench-agent-", dir="/tmp"))
    chunk: tuple[str, ...] = ("--prefill-chunk", str(prefill_chunk))
    if ranks > 1:
        chunk = (*chunk, "--pipeline", str(ranks))
    sides = [
        (MoedSide("resident", path, run_dir, ("--resident", *chunk)), False),
        (MoedSide(budget, path, run_dir, ("--cache-budget", budget, *chunk)), True),
    ]
    results: list[SideResult] = []
    bound = None
    proc = None
    try:
        with httpx.Client() as http:
            peer = None
            if not no_mlx_lm:  # up beside both sides: each turn of theirs is sent beside ours
                proc, peer = start_mlx_lm_server(path, run_dir / "mlx_lm.log", prefill_chunk)
            for side, streaming in sides:
                click.echo(
                    f"moed {side.name}: {repeats} x ({turns} turns, a restart, one more turn)"
                    + (", mlx_lm.server's turns beside" if peer else ""),
                    err=True,
                )
                results.append(run_moed_side(http, side, convs, turns, streaming, peer))
        if proc is not None:
            proc.terminate()
            proc.wait(30)
            proc = None
            click.echo(
                "plain mlx-lm: the last turns' new tokens, after their context and alone", err=True
            )
            resident = results[0].runs
            cases = [(r.last_prompt, r.turns[-1].cached_tokens or 0, r.new_text) for r in resident]
            bound = measure_bound(path, cases, prefill_chunk)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        for side, _ in sides:
            side.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    header = {
        "model": str(path),
        "system_tokens": system_tokens,
        "turns": turns,
        "user_tokens": user_tokens,
        "max_tokens": max_tokens,
        "prefill_chunk": prefill_chunk,
        "repeats": repeats,
        "ranks": ranks,
    }
    print_report(header, results, bound)
    if json_out:
        report = {**header, "sides": [asdict(r) for r in results]}
        report["model_bound"] = {**asdict(bound), "ratio": bound.ratio} if bound else None
        json_out.write_text(json.dumps(report, indent=1))
