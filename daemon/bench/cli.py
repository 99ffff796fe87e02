"""`moed bench ...`: benchmark commands that print side-by-side ratios (never timed tests)."""

from __future__ import annotations

import click

from moed.daemon.bench.serve import bench_serve


@click.group("bench")
def bench() -> None:
    """Benchmarks: each prints numbers measured side by side in one run."""


bench.add_command(bench_serve)

from moed.daemon.bench.prewarm import prewarm as _bench_prewarm  # noqa: E402

bench.add_command(_bench_prewarm)

try:  # the expert-streaming benchmark lands with the streaming engine
    from moed.daemon.bench.stream import stream as _bench_stream

    bench.add_command(_bench_stream)
except ImportError:
    pass
