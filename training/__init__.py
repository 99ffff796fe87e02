"""Training and measurement scripts for the embedded demo model (not shipped in the wheel)."""
