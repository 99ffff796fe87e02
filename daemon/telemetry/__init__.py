"""Telemetry people can read: live stats, Prometheus metrics, router traces and their analysis.

`live` builds the `stats` body from the daemon status and the expert streamer's counters; `metrics`
renders the same numbers in the Prometheus text format; `trace` records and reads router traces;
`analyze` turns traces into tables and plots; `prewarm` is the `moed bench prewarm` experiment.
"""

from moed.daemon.telemetry.live import LiveTelemetry, build_stats
from moed.daemon.telemetry.metrics import render_metrics

__all__ = ["LiveTelemetry", "build_stats", "render_metrics"]
