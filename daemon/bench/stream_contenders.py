"""`moed bench stream`'s contenders: the resident model and streaming models per budget, each
decoded one token at a time, interleaved, so that all see the same machine conditions."""

from __future__ import annotations

import random
import time
from pathlib import Path

from moed.client.progress import Progress, progress_mode
from moed.daemon.bench.stream_report import RunResult
from moed.daemon.experts import CUMULATIVE_KEYS
from moed.daemon.experts.store import PageCachePolicy, drop_page_cache
from moed.daemon.telemetry.analyze import simulate_layers
from moed.protocol.model_config import ModelConfig

# Raw pread is also sampled between decode rounds: on a shared machine (or a VM whose disk sits in
# the host's cache) the device's bandwidth drifts, and only samples taken among the tokens see the
# conditions the streaming reads saw.
RAW_EVERY = 4  # decode rounds between two raw samples
PROMPT_TOKENS = 8  # short prompts: a prefill chunk fits the smallest budget in one pass


def _prompt(seed: int, vocab: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]


class Contender:
    """One model under test (resident or streaming), stepped one decode token at a time so that
    every contender sees the same machine conditions (the runs are interleaved token by token)."""

    def __init__(
        self, name: str, model, streamer=None, preloaded: bool = False, simulate: bool = True
    ):
        self.name, self.model, self.streamer, self.preloaded = name, model, streamer, preloaded
        self.simulate = simulate  # the cache simulations start empty and know no prefetching
        self.tokens: list[int] = []
        self.token_s: list[float] = []
        self.first: dict | None = None

    def warm_up(self, prompt: list[int], n: int) -> None:
        # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        for _ in generate_step(mx.array(prompt), self.model, max_tokens=n):
            pass

    def start(self, prompt: list[int], n: int) -> None:
        # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        self._gen = generate_step(mx.array(prompt), self.model, max_tokens=n)
        tok, _ = next(self._gen)  # prefill + first token: not part of the decode measurement
        self._sync()
        self.tokens.append(int(tok))
        if self.streamer is not None:
            self.streamer.usage_counts()  # held layers' hits folded in (a sync, outside timing)
            self.first = self.streamer.snapshot()

    def step(self) -> bool:
        t0 = time.perf_counter()
        try:
            tok, _ = next(self._gen)
        except StopIteration:
            return False
        self._sync()  # include the token mlx-lm evaluates asynchronously ahead of this one
        self.token_s.append(time.perf_counter() - t0)
        self.tokens.append(int(tok))
        return True

    @staticmethod
    def _sync() -> None:
        # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        mx.synchronize(generation_stream)

    def result(self) -> RunResult:
        res = RunResult(
            self.name,
            tokens=self.tokens,
            decode_tokens=len(self.token_s),
            decode_s=sum(self.token_s),
            token_s=self.token_s,
        )
        if self.streamer is None:
            return res

        self.streamer.usage_counts()
        end = self.streamer.snapshot()
        first = self.first
        assert first is not None  # taken at the start, with the streamer
        res.counters = {k: end[k] - first[k] for k in CUMULATIVE_KEYS}
        res.slots = min(self.streamer.slots)
        res.speculation = {
            k: end[k]
            for k in (
                "prefetch_next_active",
                "prefetch_accuracy",
                "prefetch_net_ms_per_step",
                "overlap_reads_active",
                "overlap_net_ms_per_step",
            )
        }
        if "lookahead_recall" in end:  # the decode phase's share of lookahead.py's counters
            res.lookahead = {
                k: v - first[k]
                for k, v in end.items()
                if k.startswith("lookahead_") and k != "lookahead_recall"
            }
            res.lookahead["lookahead_recall"] = [
                [a - b for a, b in zip(now, was)]
                for now, was in zip(end["lookahead_recall"], first["lookahead_recall"])
            ]
        res.hits_total, res.misses_total, res.expert_bytes = (
            end["hits"],
            end["misses"],
            end["expert_bytes"],
        )
        if self.simulate:
            trace = [[set(layer.tolist()) for layer in call] for call in self.streamer.trace]
            res.policy = self.streamer.cfg.cache_policy
            lane = self.streamer.lane_layers()
            res.policy_sim = simulate_layers(trace, res.slots, res.policy, lane)
            res.belady = simulate_layers(trace, res.slots, "belady", lane)
        return res

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()


def load_resident(path: Path) -> Contender:
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    return Contender("resident", model)


def default_landing() -> str:
    """The landing the daemon's default picks on this machine (staged on CUDA, else direct)."""
    # mlx on use: every `moed` command imports the bench modules
    from moed.daemon.experts.cuda_memory import on_cuda
    from moed.daemon.experts.landing import Landing

    return Landing.AUTO.resolve(on_cuda()).value


def load_streaming(
    path: Path,
    budget: str,
    workers: int,
    page_cache: str,
    preload_all: bool = False,
    speculative: bool = False,
    active_experts: int = 0,
    landing: str = "auto",
    host_routed: bool = False,
    launch_early: bool | None = None,
    lookahead: bool = False,
) -> Contender:
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.core as mx
    from mlx_lm.utils import load_model

    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from moed.daemon.experts import StreamingConfig, install_streaming
    from moed.daemon.experts.landing import Landing

    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model,
        path,
        StreamingConfig(
            cache_budget=budget,
            prefetch_workers=workers,
            page_cache=PageCachePolicy(page_cache),
            prefetch_next=speculative,
            landing=Landing(landing),
            launch_early=launch_early,
            lookahead=lookahead,
        ),
    )
    mx.eval(model.parameters())
    if active_experts:
        # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
        from moed.daemon.experts.active_experts import ActiveExpertsError, limit_active_experts

        native = ModelConfig.read(path).experts_per_token
        if native is None:  # as the daemon's load refuses it (model/loader.py)
            raise ActiveExpertsError("the checkpoint names no experts per token to reduce")
        limit_active_experts(model, native, active_experts)
    if preload_all:
        streamer.preload([list(range(n)) for n in streamer.layout.num_experts])
    simulate = not (preload_all or speculative)
    # The simulations replay the routing trace, which needs the choices on the host: a traced
    # run never routes on the device, so the preloaded run (no simulation) goes untraced.
    streamer.record_routing(trace=simulate, device_routing=not host_routed)
    name = budget + ("+pre" if preload_all else "") + ("+spec" if speculative else "")
    name += "+look" if lookahead else ""
    name += ",host" if host_routed else ""
    name += ",late" if launch_early is False else ""
    name += f",K={active_experts}" if active_experts else ""
    name += f",{landing}" if landing != "auto" else ""  # a landing other than the default
    return Contender(name, model, streamer, preloaded=preload_all, simulate=simulate)


def measure(
    contenders: list[Contender],
    files: list[Path],
    warm_prompt,
    prompt,
    warmup: int,
    tokens: int,
    between=None,
) -> None:
    """Warm up, then decode every contender one token at a time in turn (a round: one token each,
    in an order rotating by round); `between(i)` runs every RAW_EVERY rounds, outside every
    contender's timing."""
    drop_page_cache(files)
    for c in contenders:
        c.warm_up(warm_prompt, warmup)
    for c in contenders:
        c.start(prompt, tokens)
    active = list(contenders)
    # A bar on a terminal only (outside each contender's own timing); stdout keeps the report.
    total = tokens * len(contenders)
    with Progress("bench stream: decode", progress_mode(False), total=total) as bar:
        done = rounds = 0
        while active:
            done += len(active)
            # The order rotates round by round, so no contender always runs right after another.
            turn = rounds % len(active)
            order = active[turn:] + active[:turn]
            stepped = {id(c) for c in order if c.step()}
            active = [c for c in active if id(c) in stepped]
            bar.update(min(done, total))
            rounds += 1
            if between is not None and active and rounds % RAW_EVERY == 0:
                between(rounds // RAW_EVERY)
