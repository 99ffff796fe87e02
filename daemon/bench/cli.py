"""`moed bench ...`: benchmark commands that print side-by-side ratios (never timed tests)."""

from __future__ import annotations

import click

from moed.daemon.bench.agent import bench_agent
from moed.daemon.bench.batch import bench_batch
from moed.daemon.bench.pipeline import pipeline
from moed.daemon.bench.policy import policy
from moed.daemon.bench.prewarm import prewarm
from moed.daemon.bench.prompt import prompt_bench
from moed.daemon.bench.recall import recall
from moed.daemon.bench.replica import bench_replica
from moed.daemon.bench.serve import bench_serve
from moed.daemon.bench.stream import stream
from moed.daemon.bench.structured import bench_format
from moed.daemon.bench.switch import bench_switch


@click.group("bench")
def bench() -> None:
    """Benchmarks: each prints numbers measured side by side in one run."""


bench.add_command(bench_agent)
bench.add_command(bench_batch)
bench.add_command(bench_format)
bench.add_command(bench_serve)
bench.add_command(pipeline)
bench.add_command(policy)
bench.add_command(prewarm)
bench.add_command(prompt_bench)
bench.add_command(recall)
bench.add_command(bench_replica)
bench.add_command(stream)
bench.add_command(bench_switch)
