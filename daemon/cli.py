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
    # Each subcommand lives beside the code it drives; imported here, after
    # raise_open_file_limit() above (mlx-lm, imported first, would cap the limit at 2048).
    from moed.daemon.bench.cli import bench
    from moed.daemon.bench.plan import plan
    from moed.daemon.distributed.cli import rank
    from moed.daemon.runtime.cli import serve
    from moed.daemon.service.cli import service
    from moed.daemon.telemetry.cli import trace
    from moed.daemon.watchdog.cli import watchdog
    from moed.gateway.cli import gateway  # imports no mlx: the gateway is a client of the daemon

    for command in (serve, watchdog, service, bench, plan, trace, gateway, rank):
        main.add_command(command)


_register()
add_global_options(main)  # last: every registered command takes --socket, --state-dir, --log-dir


if __name__ == "__main__":
    main()
