"""One way to print a byte count, shared by the daemon and every client (one unit everywhere).

Decimal SI units (kB, MB, GB): the units `--cache-budget 12GB` is parsed in, as macOS shows.
"""

from __future__ import annotations

_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def format_bytes(n: float | int | None, missing: str = "-") -> str:
    """`94.9 MB`, `1.50 GB`, `512 B`; `missing` for None."""
    if n is None:
        return missing
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1000 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{value:.0f} B"
            return f"{value:.2f} {unit}" if abs(value) < 10 else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_duration(seconds: float | None, missing: str = "-") -> str:
    """`45s`, `12m 5s`, `3h 20m`: how long a model has been idle or a daemon up."""
    if seconds is None:
        return missing
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    return f"{s // 3600}h {s % 3600 // 60}m"
