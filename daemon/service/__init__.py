"""Run moed as a per-user service: launchd LaunchAgents on macOS, systemd --user units on Linux."""

from .launchctl import previous_exit as previous_exit_from_launchd
from .logs import RotatingLog, record_start

__all__ = ["RotatingLog", "previous_exit_from_launchd", "record_start"]
