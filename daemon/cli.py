"""`moed`: the daemon-side command line (serve, watchdog, service, bench, trace)."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moed")
def main() -> None:
    """moed: run Mixture-of-Experts models larger than memory as a background service."""


def _register() -> None:
    # Each subcommand lives beside the code it drives; import errors surface at startup, not later.
    from moed.daemon.runtime.cli import serve

    main.add_command(serve)
    from moed.daemon.watchdog.cli import watchdog

    main.add_command(watchdog)
    from moed.daemon.service.cli import service

    main.add_command(service)
    from moed.daemon.bench.cli import bench

    main.add_command(bench)
    from moed.daemon.telemetry.cli import trace

    main.add_command(trace)


_register()


if __name__ == "__main__":
    main()
