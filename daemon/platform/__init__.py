"""Memory readings from the operating system, behind one small interface.

The watchdog asks three questions: how much swap is in use, what is the kernel's memory-pressure
level, and how much memory does one process hold. macOS answers through sysctl; Linux through
/proc (meminfo, PSI). Free memory is deliberately not among them: with memory-mapped or cached
weights it swings by gigabytes while nothing is wrong.
"""

from __future__ import annotations

import abc
import enum
import sys
from dataclasses import dataclass


class PressureLevel(str, enum.Enum):
    NORMAL = "normal"
    WARN = "warn"
    CRITICAL = "critical"
    UNKNOWN = "unknown"  # no pressure source on this system (or it could not be read)


@dataclass(frozen=True)
class Footprint:
    """Memory held by one process, in bytes; None where the platform does not say."""

    resident_bytes: int
    swap_bytes: int | None = None
    phys_footprint_bytes: int | None = None  # macOS: what Activity Monitor calls Memory


class MemoryProbe(abc.ABC):
    name: str = "probe"

    @abc.abstractmethod
    def swap_used_bytes(self) -> int | None:
        """Swap in use system-wide; None when it cannot be read."""

    @abc.abstractmethod
    def pressure_level(self) -> PressureLevel:
        """The kernel's view of memory pressure right now."""

    @abc.abstractmethod
    def process_footprint(self, pid: int) -> Footprint | None:
        """None when the process does not exist (or is not ours to read)."""


def probe_for_platform(platform: str | None = None) -> MemoryProbe:
    platform = platform or sys.platform
    if platform == "darwin":
        # this OS's twin only: the other one's modules may not exist here
        from moed.daemon.platform.macos import MacOSProbe

        return MacOSProbe()
    if platform.startswith("linux"):
        # this OS's twin only: the other one's modules may not exist here
        from moed.daemon.platform.linux import LinuxProbe

        return LinuxProbe()
    raise RuntimeError(f"no memory probe for platform {platform!r}")
