"""What every rank must agree on, decided once by rank 0 and handed to each follower as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from moed.daemon.config import ServeConfig
from moed.daemon.distributed.hostfile import GroupSpec, load_hostfile, local_group
from moed.daemon.distributed.launch import free_port_run
from moed.daemon.distributed.split import SplitMode, parse_split
from moed.daemon.experts.budget import parse_size
from moed.daemon.experts.store import PageCachePolicy
from moed.protocol.model_config import ModelConfig


@dataclass(frozen=True)
class RankSpec:
    model_path: str
    split: list[int] | str  # layers per rank (rank 0 first), or a SplitMode value
    budgets: list[str | None]  # each rank's expert cache budget; None: every expert resident
    prefetch_workers: int = 0
    page_cache: str = PageCachePolicy.AUTO.value
    memory_limit_bytes: int = 0
    kv_bytes: int = 0  # the whole model's KV estimate; each rank plans for its share
    # The prefix cache's memory tier for the whole model (None: each plan's automatic share);
    # each rank keeps its own layers of every entry and plans for its share.
    prefix_cache_bytes: int | None = None
    # Its SSD tier for the whole model (0: none) and the folder each rank's own folder sits in.
    prefix_disk_bytes: int = 0
    prefix_disk_dir: str = ""
    backend: str = "ring"
    # Ranks on other hosts bind that host's moed socket for its watchdog (never rank 0's host).
    control: list[bool] | None = None
    guard: str = ""  # "ip:port" of rank 0's guard, which hands out the ring's addresses
    rank_ips: list[list[str]] | None = None  # each rank's hostfile addresses (its ring binds there)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))

    def split_for(self, size: int, num_layers: int) -> tuple[int, ...] | SplitMode:
        if isinstance(self.split, str):
            return parse_split(self.split, size, num_layers)
        return tuple(self.split)

    def streaming(self, rank: int):
        """This rank's StreamingConfig, or None when its experts stay resident."""
        # the streamer (mlx-lm) on use: `moed rank`, registered in every `moed` command, reads this
        from moed.daemon.experts import StreamingConfig

        budget = self.budgets[rank]
        if budget is None:
            return None
        return StreamingConfig(
            cache_budget=budget,
            prefetch_workers=self.prefetch_workers,
            page_cache=PageCachePolicy(self.page_cache),
            memory_bytes=self.memory_limit_bytes,
            kv_bytes=self.kv_bytes,
            prefix_cache_bytes=self.prefix_cache_bytes,
        )


def group_spec(serve: ServeConfig) -> GroupSpec:
    """The group a daemon configuration asks for (`--hostfile` wins over `--pipeline N`)."""
    if serve.hostfile:
        return load_hostfile(Path(serve.hostfile).expanduser(), serve.pipeline_port or 32323)
    return local_group(serve.pipeline, serve.pipeline_port or free_port_run(serve.pipeline))


def rank_spec(
    serve: ServeConfig, group: GroupSpec, model_path: Path, model_config: ModelConfig
) -> RankSpec:
    # the streamer (mlx-lm) on use: `moed rank`, registered in every `moed` command, reads this
    from moed.daemon.experts import estimate_kv_bytes
    from moed.daemon.model.loader import prefix_cache_memory_bytes

    split: list[int] | str = serve.pipeline_split
    if group.given_split is not None:
        split = list(group.given_split)
    default = None if serve.resident else str(serve.cache_budget)
    memory = prefix_cache_memory_bytes(serve)  # 0: no prefix cache, so no SSD tier either
    budgets = [h.expert_budget if h.expert_budget is not None else default for h in group.hosts]
    return RankSpec(
        model_path=str(model_path),
        split=split,
        budgets=budgets,
        prefetch_workers=serve.prefetch_workers,
        page_cache=serve.page_cache.value,
        memory_limit_bytes=serve.memory_limit_bytes,
        kv_bytes=estimate_kv_bytes(model_config, serve.plan_context_tokens),
        prefix_cache_bytes=memory,
        prefix_disk_bytes=0 if memory == 0 else parse_size(serve.prefix_cache_disk_bytes),
        prefix_disk_dir=str(serve.prefix_cache_folder),
        backend=group.backend.value,
        control=[not h.is_local for h in group.hosts],
        guard=f"{group.guard_address[0]}:{group.guard_address[1]}",
        rank_ips=[list(h.ips) for h in group.hosts],
    )
