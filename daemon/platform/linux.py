"""Linux readings: swap from /proc/meminfo, pressure from PSI (/proc/pressure/memory).

PSI reports the share of wall time in which some (or all) runnable tasks were stalled on memory;
the avg10 window is the closest match to macOS's instantaneous pressure level.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moed.daemon.platform import Footprint, MemoryProbe, PressureLevel


@dataclass(frozen=True)
class PSI:
    some_avg10: float
    full_avg10: float | None  # absent on kernels that report only "some"


@dataclass(frozen=True)
class PSIThresholds:
    """avg10 percentages. Page-cache churn stalls a reader briefly; thrashing stalls everything."""

    warn_some: float = 10.0
    critical_some: float = 60.0
    critical_full: float = 30.0


def parse_meminfo(text: str) -> dict[str, int]:
    """Parse /proc/meminfo into bytes ("SwapFree:  123 kB" -> {"SwapFree": 125952})."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        out[name.strip()] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return out


def swap_used_from_meminfo(text: str) -> int:
    info = parse_meminfo(text)
    try:
        return max(0, info["SwapTotal"] - info["SwapFree"])
    except KeyError:
        raise ValueError("/proc/meminfo has no SwapTotal/SwapFree") from None


def parse_psi(text: str) -> PSI:
    """Parse a PSI file: lines like `some avg10=0.12 avg60=0.05 avg300=0.01 total=12345`."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        for pair in pairs:
            key, _, number = pair.partition("=")
            if key == "avg10":
                values[kind] = float(number)
    if "some" not in values:
        raise ValueError(f"not PSI output: {text.strip()!r}")
    return PSI(values["some"], values.get("full"))


def level_from_psi(psi: PSI, thresholds: PSIThresholds = PSIThresholds()) -> PressureLevel:
    if (
        psi.some_avg10 >= thresholds.critical_some
        or (psi.full_avg10 or 0.0) >= thresholds.critical_full
    ):
        return PressureLevel.CRITICAL
    if psi.some_avg10 >= thresholds.warn_some:
        return PressureLevel.WARN
    return PressureLevel.NORMAL


class LinuxProbe(MemoryProbe):
    name = "linux"

    def __init__(self, proc: Path = Path("/proc"), thresholds: PSIThresholds = PSIThresholds()):
        self.proc = proc
        self.thresholds = thresholds

    def swap_used_bytes(self) -> int | None:
        try:
            return swap_used_from_meminfo((self.proc / "meminfo").read_text())
        except (OSError, ValueError):
            return None

    def psi(self) -> PSI | None:
        try:
            return parse_psi((self.proc / "pressure" / "memory").read_text())
        except (OSError, ValueError):  # no PSI (CONFIG_PSI off, or psi=0 on the command line)
            return None

    def pressure_level(self) -> PressureLevel:
        psi = self.psi()
        return PressureLevel.UNKNOWN if psi is None else level_from_psi(psi, self.thresholds)

    def process_footprint(self, pid: int) -> Footprint | None:
        try:
            status = parse_meminfo((self.proc / str(pid) / "status").read_text())
        except (OSError, ValueError):
            return None
        if "VmRSS" not in status:  # a zombie or a kernel thread
            return None
        return Footprint(resident_bytes=status["VmRSS"], swap_bytes=status.get("VmSwap"))
