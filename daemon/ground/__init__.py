"""The ground floor of the daemon: what every room may use (crash records, faults for tests, atomic
state files, the run log, exit codes, the open-file limit, the watchdog's state file, the probe of a
live daemon). It imports no other room of moed.daemon, only moed.protocol."""
