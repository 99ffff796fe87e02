"""`moed rank`: one follower rank of a pipeline (started by rank 0, never by hand)."""

from __future__ import annotations

import signal
import sys

import click

from moed.client.cli_common import log_level_option, log_to_stderr
from moed.daemon.distributed.launch import Heartbeat, read_secret
from moed.daemon.distributed.spec import RankSpec


@click.command(hidden=True)
@click.option("--spec", "spec_json", required=True, help="What rank 0 decided (JSON).")
@click.option("--rank", type=int, required=True, help="This process's rank in the group.")
@log_level_option
def rank(spec_json: str, rank: int, log_level: str) -> None:
    """Follow rank 0's steps through this rank's layers."""
    log_to_stderr(log_level, tag=f"rank{rank} ")
    # the model (mlx-lm) only in a rank process: every `moed` command registers `rank`
    from moed.daemon.distributed.follower import run_follower

    # Rank 0 decides when the group ends: a Ctrl-C in its terminal reaches this process group
    # too, and must not kill a rank mid-step before rank 0 has said goodbye.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        secret = read_secret(sys.stdin.buffer)  # before the heartbeat's watcher reads stdin
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    heartbeat = Heartbeat()
    heartbeat.start()
    sys.exit(run_follower(RankSpec.from_json(spec_json), rank, secret, heartbeat))
