"""Exit codes of `moe`, documented in README.md."""

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1  # unexpected failure in the client itself
    USAGE = 2  # bad command line (click's own code)
    DAEMON_UNAVAILABLE = 3  # no daemon answered (and none could be started)
    REQUEST_FAILED = 4  # the daemon refused or failed the request (typed error)
    DAEMON_RESTARTED = 5  # the daemon died or restarted mid-request
    MODEL_UNAVAILABLE = 6  # pull / rm: not on the Hub, not in the cache, or arrived damaged
    INTERRUPTED = 130  # Ctrl-C; the request was cancelled
