"""The expert streamer's settings (streamer.py), built at the edge: the daemon's configuration
(daemon/config.py via model/loader.py), benches and tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moed.daemon.experts.budget import CacheBudget
from moed.daemon.experts.landing import Landing
from moed.daemon.experts.policies import DEFAULT_POLICY
from moed.daemon.experts.store import PageCachePolicy


@dataclass(frozen=True)
class StreamingConfig:
    # parsed (CacheBudget) by the daemon's configuration; text from bench and tests: bytes, "12GB",
    # "25%", "0.25" or "auto"
    cache_budget: CacheBudget | str | int = "auto"
    prefetch_workers: int = 0  # 0: sized to the machine
    page_cache: PageCachePolicy = PageCachePolicy.AUTO
    state_dir: Path | None = None  # where the usage profile lives; None: no profile
    memory_bytes: int = 0  # 0: detect (RAM, cgroup limit, Metal working set)
    kv_bytes: int = 0  # KV cache estimate the auto budget leaves room for
    # The prefix cache's memory tier, planned beside the KV cache; None: the plan's automatic share.
    prefix_cache_bytes: int | None = 0
    working_bytes: int = 0  # 0: default estimate
    # Speculative: while layer L computes, read the experts layer L+1's router picks for layer L's
    # input. Exact either way (it only changes what is resident); costs bandwidth when wrong.
    prefetch_next: bool = False
    # Read the next layer's guessed experts into a lane beside the pools, only while the disk
    # would idle (lookahead.py): exact, evicts nothing; off where it has not measured faster.
    lookahead: bool = False
    cache_policy: str = DEFAULT_POLICY  # a name in experts/policies (the registry)
    landing: Landing = Landing.AUTO  # where reads land (landing.py): STAGED on CUDA, else DIRECT
    # Submit each host-routed layer's output to the device once built (mx.async_eval), so the
    # device computes it while the host builds the graph up to the next router's read-back
    # (H200: a read-back's wait 5.3 -> 3.2 ms a token; BENCHMARKS.md, issue 22 fifth session).
    # None: where MLX computes on a GPU; on the CPU it bought nothing and cost host time.
    launch_early: bool | None = None
