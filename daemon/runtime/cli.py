"""`moed serve`: the daemon in the foreground (launchd/systemd or `moe run` put it in the
background)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from moed.client.cli_common import global_options, log_level_option, log_to_stderr
from moed.daemon.config import ConfigError, load_config
from moed.daemon.experts.policies import DEFAULT_POLICY, policy_names
from moed.daemon.experts.store import PageCachePolicy
from moed.daemon.ground.exit_codes import ConfigExit, for_supervisor
from moed.daemon.ground.open_files import OpenFileLimitTooLow, require_open_files


@click.command()
@click.option(
    "--model", help="Model folder, Hugging Face id (from the local cache), or 'demo' (default)."
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="TOML config file.",
)
@click.option(
    "--cache-budget", help="Expert cache budget: bytes, 12GB, 25% of the experts, or auto."
)
@click.option(
    "--resident/--streaming",
    default=None,
    help="Keep every expert resident (plain mlx-lm) or stream them.",
)
@click.option(
    "--prefetch-workers", type=int, help="Expert read threads (default: sized to the machine)."
)
@click.option(
    "--prefetch-next/--no-prefetch-next",
    default=None,
    help="Speculatively read the next layer's experts (never changes tokens).",
)
@click.option(
    "--lookahead/--no-lookahead",
    default=None,
    help="Read the next layer's guessed experts while the disk idles (never changes tokens).",
)
@click.option(
    "--cache-policy",
    type=click.Choice(policy_names()),
    help=f"Expert eviction policy (default: {DEFAULT_POLICY}).",
)
@click.option(
    "--page-cache",
    type=click.Choice([p.value for p in PageCachePolicy]),
    help="Bypass or trust the OS page cache for expert reads (auto: bypass once the experts "
    "exceed half of memory; bypassed reads use F_NOCACHE on macOS, O_DIRECT on Linux).",
)
@click.option(
    "--max-active-experts",
    type=int,
    help="Lossy, opt-in: each token uses its K best experts instead of the model's top-k (fewer "
    "bytes read per token; every response says so). 0: the model's own routing (default).",
)
@click.option("--max-batch", type=int, help="Requests decoded together in one batch (default 8).")
@click.option(
    "--prefill-chunk",
    type=int,
    help="Prompt tokens read per step between decode steps (default 256).",
)
@click.option(
    "--batch-window-ms",
    type=float,
    help="An idle daemon waits this long for more requests to start as one batch (default 0).",
)
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on 127.0.0.1:PORT.")
@click.option(
    "--trace-dir",
    help="Record a router trace of every generation into this folder (.moetrace files).",
)
@click.option(
    "--keep-alive",
    help="Release the model and the expert cache after this idle time; the next request reloads "
    "it: 30s, 5m (default), 1h, -1 never, 0 as soon as idle. A request's keep_alive overrides it.",
)
@click.option(
    "--pipeline",
    type=click.IntRange(min=2),
    help="Run the model over N local ranks (mx.distributed ring backend on loopback).",
)
@click.option(
    "--hostfile",
    type=click.Path(dir_okay=False),
    help="Run over the hosts of an mlx.launch hostfile (+ per-host expert_budget and layers).",
)
@click.option(
    "--pipeline-split",
    help="Layers per rank: even (default), cost (from the checkpoint), or N,N,... (rank 0 first).",
)
@click.option(
    "--prefix-cache",
    "prefix_cache_bytes",
    help="Prefix KV cache in memory: a size (default 1GB), 0 for none.",
)
@click.option(
    "--prefix-cache-disk",
    "prefix_cache_disk_bytes",
    help="Prefix KV cache on the SSD: a size (default 10GB), 0 for none.",
)
@click.option(
    "--prefix-cache-dir", help="The SSD tier's folder (default: <state dir>/prefix-cache)."
)
@click.option(
    "--prefix-checkpoint-tokens",
    type=int,
    help="Hybrid models: tokens between recurrent-state checkpoints (default 1024).",
)
@log_level_option
def serve(
    model,
    config_file,
    cache_budget,
    resident,
    prefetch_workers,
    prefetch_next,
    lookahead,
    cache_policy,
    page_cache,
    max_active_experts,
    max_batch,
    prefill_chunk,
    batch_window_ms,
    metrics_port,
    trace_dir,
    keep_alive,
    pipeline,
    hostfile,
    pipeline_split,
    prefix_cache_bytes,
    prefix_cache_disk_bytes,
    prefix_cache_dir,
    prefix_checkpoint_tokens,
    log_level,
) -> None:
    """Run the daemon in the foreground until SIGTERM or `moe stop`."""
    log_to_stderr(log_level)
    given = global_options()
    try:
        config = load_config(
            config_file,
            serve_overrides={
                "model": model,
                "socket": given.socket,
                "cache_budget": cache_budget,
                "resident": resident,
                "prefetch_workers": prefetch_workers,
                "page_cache": page_cache,
                "prefetch_next": prefetch_next,
                "lookahead": lookahead,
                "cache_policy": cache_policy,
                "max_active_experts": max_active_experts,
                "state_dir": given.state_dir,
                "log_dir": given.log_dir,
                "max_batch": max_batch,
                "prefill_chunk": prefill_chunk,
                "batch_window_ms": batch_window_ms,
                "metrics_port": metrics_port,
                "trace_dir": trace_dir,
                "keep_alive": keep_alive,
                "pipeline": pipeline,
                "hostfile": hostfile,
                "pipeline_split": pipeline_split,
                "prefix_cache_bytes": prefix_cache_bytes,
                "prefix_cache_disk_bytes": prefix_cache_disk_bytes,
                "prefix_cache_dir": prefix_cache_dir,
                "prefix_checkpoint_tokens": prefix_checkpoint_tokens,
            },
        )
    except ConfigError as exc:
        raise ConfigExit(exc) from None

    try:
        require_open_files()
    except OpenFileLimitTooLow as exc:
        raise ConfigExit(exc) from None
    # the daemon (engine, mlx-lm) only when serving: every `moed` command imports this module
    from moed.daemon.runtime.main import run_daemon

    sys.exit(for_supervisor(run_daemon(config)))
