"""`moed watchdog`: the swap guard and progress watchdog, in the foreground."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from moed.client.cli_common import global_options, log_level_option, log_to_stderr
from moed.daemon.config import ConfigError, load_config
from moed.daemon.ground.exit_codes import ConfigExit
from moed.daemon.watchdog.runner import Watchdog


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="TOML config file.",
)
@click.option("--interval", type=float, help="Seconds between samples.")
@click.option("--consecutive", type=int, help="Bad samples in a row before acting.")
@click.option(
    "--swap-growth-mb", type=float, help="Swap growth over the baseline that counts as bad."
)
@click.option(
    "--progress-timeout",
    type=float,
    help="Seconds busy without a token before the daemon counts as wedged.",
)
@click.option("--step-grace", type=float, help="Seconds between escalation steps.")
@click.option("--pid", type=int, help="The daemon's pid (default: the pid its status reports).")
@click.option(
    "--once",
    is_flag=True,
    help="Take one sample, print readings and verdict as JSON, take no action.",
)
@log_level_option
def watchdog(
    config_file,
    interval,
    consecutive,
    swap_growth_mb,
    progress_timeout,
    step_grace,
    pid,
    once,
    log_level,
) -> None:
    """Guard memory (swap growth, pressure) and progress; escalate shed -> shutdown -> SIGTERM
    -> SIGKILL."""
    log_to_stderr(log_level)
    given = global_options()
    try:
        config = load_config(
            config_file,
            watchdog_overrides={
                "socket": given.socket,
                "state_dir": given.state_dir,
                "interval_s": interval,
                "consecutive": consecutive,
                "swap_growth_mb": swap_growth_mb,
                "progress_timeout_s": progress_timeout,
                "step_grace_s": step_grace,
            },
        ).watchdog
    except ConfigError as exc:
        raise ConfigExit(exc) from None

    dog = Watchdog(config, pid_override=pid)
    if once:
        sample = dog.sampler.sample()
        decision = dog.policy.observe(sample)
        dog.link.close()
        click.echo(
            json.dumps(
                {
                    "state": decision.state.value,
                    "reason": decision.reason,
                    "readings": decision.readings,
                },
                indent=2,
            )
        )
        return
    dog.install_signal_handlers()
    sys.exit(dog.run())
