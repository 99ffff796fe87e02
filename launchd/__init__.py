"""Service templates (launchd plists, systemd units), shipped as package data `moed.launchd`."""
