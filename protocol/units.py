"""One way to print a byte count, shared by the daemon and every client (one unit everywhere).

Decimal SI units (kB, MB, GB): the units `--cache-budget 12GB` is parsed in, as macOS shows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_keep_alive(spec: str | int | float) -> float | None:
    """Seconds to keep an idle model loaded, as ollama reads `keep_alive`: a number of seconds or
    a duration (`30s`, `5m`, `1h30m`); negative: forever (None); 0: unload as soon as idle.
    Raises ValueError for anything else."""
    if isinstance(spec, bool):
        raise ValueError(f"keep_alive {spec!r} is not a duration")
    if isinstance(spec, (int, float)):
        seconds = float(spec)
    else:
        text = str(spec).strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _parse_duration(text)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"keep_alive {spec!r} is not a finite duration")
    return None if seconds < 0 else seconds


def _parse_duration(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"keep_alive {text!r} is not a duration (use 30s, 5m, 1h, 0 or -1)")
    return sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


@dataclass(frozen=True)
class KeepAliveDuration:
    """A request's keep_alive, decoded once at the edge: the seconds the model stays loaded after
    it (`seconds`; None: never) and the value as the client wrote it (sent on as it came)."""

    written: str | int | float
    seconds: float | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds", parse_keep_alive(self.written))  # ValueError: not one

    def to_wire(self) -> str | int | float:
        return self.written


def format_keep_alive(seconds: float | None) -> str:
    return "never" if seconds is None else format_duration(seconds)
