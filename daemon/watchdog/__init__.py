"""The watchdog: a separate process that guards the machine's memory and the daemon's progress.

sampler (readings) -> policy (pure decisions) -> runner (acts through the control channel, then
signals) -> events (JSON-lines log + an atomically written state file for `moe status`).
"""
