"""Exit codes of `moed serve`. systemd restarts on any non-zero code but the permanent ones
(RestartPreventExitStatus); launchd's KeepAlive cannot tell codes apart, so under it
(MOED_SUPERVISOR=launchd, set by the plist) a permanent failure exits 0 after saying why."""

import enum
import os
from collections.abc import Mapping

import click


class DaemonExit(enum.IntEnum):
    OK = 0  # clean shutdown (also: restart budget exhausted, so KeepAlive does not loop)
    FAILED = 1  # the model failed to load or the engine died
    CONFIG = 2
    MODEL_NOT_FOUND = 3
    ALREADY_RUNNING = 4
    OUT_OF_MEMORY = 5
    DOES_NOT_FIT = 6  # the memory plan refused the model at this budget: a restart cannot help
    RANK_FAILED = 7  # another rank of the pipeline died or stalled: restart the whole group
    MODEL_UNUSABLE = 8  # the checkpoint loads but cannot tokenize (no tokenizer): fix the files


# Failures a restart cannot fix: the service manager must leave the daemon down.
PERMANENT_EXITS = (
    DaemonExit.CONFIG,
    DaemonExit.MODEL_NOT_FOUND,
    DaemonExit.ALREADY_RUNNING,
    DaemonExit.DOES_NOT_FIT,
    DaemonExit.MODEL_UNUSABLE,
)


def for_supervisor(code: int, environ: Mapping[str, str] | None = None) -> int:
    """The code to exit with: a permanent failure under launchd exits 0, so it is not restarted."""
    environ = os.environ if environ is None else environ
    if environ.get("MOED_SUPERVISOR") == "launchd" and code in PERMANENT_EXITS:
        return DaemonExit.OK
    return code


class ConfigExit(click.ClickException):
    """A configuration error on a `moed` command: one line on stderr, exit 2 (a unit does not
    restart on it)."""

    def __init__(self, error: Exception):
        super().__init__(f"configuration: {error}")
        self.exit_code = for_supervisor(DaemonExit.CONFIG)
