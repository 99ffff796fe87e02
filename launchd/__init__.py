"""launchd LaunchAgent plist templates, shipped as package data `moed.launchd` (the systemd
units are in daemon/service/units/)."""
