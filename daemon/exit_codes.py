"""Exit codes of `moed serve`; launchd/systemd restart on any non-zero code."""

import enum


class DaemonExit(enum.IntEnum):
    OK = 0  # clean shutdown (also: restart budget exhausted, so KeepAlive does not loop)
    FAILED = 1  # the model failed to load or the engine died
    CONFIG = 2
    MODEL_NOT_FOUND = 3
    ALREADY_RUNNING = 4
    OUT_OF_MEMORY = 5
    DOES_NOT_FIT = 6  # the memory plan refused the model at this budget: a restart cannot help
    RANK_FAILED = 7  # another rank of the pipeline died or stalled: restart the whole group
