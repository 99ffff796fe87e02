"""Run moed as a per-user service: launchd LaunchAgents on macOS, systemd --user units on Linux."""
