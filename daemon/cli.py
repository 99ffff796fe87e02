"""`moed`: the daemon-side command line (serve, watchdog, service, bench, trace)."""

from __future__ import annotations

import click

from moed.client.cli_common import CONTEXT_SETTINGS, add_global_options
from moed.daemon.ground.open_files import raise_open_file_limit

# First: before any subcommand's imports reach mlx-lm, which would cap the limit at 2048.
raise_open_file_limit()


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="moed", prog_name="moed")
def main() -> None:
    """moed: run Mixture-of-Experts models larger than memory as a background service.

    Shell completion: eval "$(_MOED_COMPLETE=bash_source moed)" (zsh_source, fish_source).
    """


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
    from moed.gateway.cli import gateway  # imports no mlx: the gateway is a client of the daemon

    main.add_command(gateway)
    from moed.daemon.distributed.cli import rank

    main.add_command(rank)


_register()
add_global_options(main)  # last: every registered command takes --socket, --state-dir, --log-dir


if __name__ == "__main__":
    main()
