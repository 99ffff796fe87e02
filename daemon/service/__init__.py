"""Run moed as a per-user service: launchd LaunchAgents on macOS, systemd --user units on Linux."""

from .logs import RotatingLog, record_start

__all__ = ["RotatingLog", "record_start"]
