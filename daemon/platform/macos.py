"""macOS readings: `sysctl vm.swapusage` and `kern.memorystatus_vm_pressure_level`.

The parsers take the text sysctl prints, so they are tested on Linux against recorded output.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import subprocess
from dataclasses import dataclass

import psutil

from moed.daemon.platform import Footprint, MemoryProbe, PressureLevel

_MIB = 1024 * 1024
# sysctl(8) prints xsw_usage as "total = %.2fM  used = %.2fM  free = %.2fM  %s" (MiB, always "M").
_SWAP_FIELD = re.compile(r"\b(total|used|free)\s*=\s*([0-9]+(?:\.[0-9]+)?)([KMGT]?)", re.IGNORECASE)
_UNIT = {"": _MIB, "K": 1024, "M": _MIB, "G": 1024 * _MIB, "T": 1024 * 1024 * _MIB}
# kern.memorystatus_vm_pressure_level: the kernel's dispatch levels (1 normal, 2 warn, 4 critical).
_LEVELS = {1: PressureLevel.NORMAL, 2: PressureLevel.WARN, 4: PressureLevel.CRITICAL}

SYSCTL = "/usr/sbin/sysctl"
SYSCTL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SwapUsage:
    total_bytes: int
    used_bytes: int
    free_bytes: int
    encrypted: bool


def parse_swapusage(text: str) -> SwapUsage:
    """Parse `sysctl vm.swapusage` (with or without the name prefix, i.e. also `sysctl -n`)."""
    fields = {}
    for name, number, unit in _SWAP_FIELD.findall(text):
        fields[name.lower()] = int(round(float(number) * _UNIT[unit.upper()]))
    missing = {"total", "used", "free"} - fields.keys()
    if missing:
        raise ValueError(
            f"not vm.swapusage output (missing {', '.join(sorted(missing))}): {text.strip()!r}"
        )
    return SwapUsage(fields["total"], fields["used"], fields["free"], "(encrypted)" in text)


def parse_pressure_level(text: str) -> PressureLevel:
    """Parse `sysctl kern.memorystatus_vm_pressure_level` (or its `-n` form)."""
    value = text.strip().rsplit(":", 1)[-1].strip()
    try:
        return _LEVELS.get(int(value), PressureLevel.UNKNOWN)
    except ValueError:
        raise ValueError(f"not a pressure level: {text.strip()!r}") from None


def _sysctl(name: str) -> str:
    proc = subprocess.run(
        [SYSCTL, name], capture_output=True, text=True, timeout=SYSCTL_TIMEOUT_S, check=True
    )
    return proc.stdout


class MacOSProbe(MemoryProbe):
    name = "macos"

    def swap_used_bytes(self) -> int | None:
        try:
            return parse_swapusage(_sysctl("vm.swapusage")).used_bytes
        except (OSError, subprocess.SubprocessError, ValueError):
            return None

    def pressure_level(self) -> PressureLevel:
        try:
            return parse_pressure_level(_sysctl("kern.memorystatus_vm_pressure_level"))
        except (OSError, subprocess.SubprocessError, ValueError):
            return PressureLevel.UNKNOWN

    def process_footprint(self, pid: int) -> Footprint | None:
        try:
            rss = psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        return Footprint(resident_bytes=rss, phys_footprint_bytes=_phys_footprint(pid))


class _RUsageInfoV0(ctypes.Structure):
    # <sys/resource.h> struct rusage_info_v0; ri_phys_footprint is what Activity Monitor shows.
    _fields_ = [
        ("ri_uuid", ctypes.c_uint8 * 16),
        ("ri_user_time", ctypes.c_uint64),
        ("ri_system_time", ctypes.c_uint64),
        ("ri_pkg_idle_wkups", ctypes.c_uint64),
        ("ri_interrupt_wkups", ctypes.c_uint64),
        ("ri_pageins", ctypes.c_uint64),
        ("ri_wired_size", ctypes.c_uint64),
        ("ri_resident_size", ctypes.c_uint64),
        ("ri_phys_footprint", ctypes.c_uint64),
        ("ri_proc_start_abstime", ctypes.c_uint64),
        ("ri_proc_exit_abstime", ctypes.c_uint64),
    ]


_libproc = None


def _phys_footprint(pid: int) -> int | None:
    global _libproc
    try:
        if _libproc is None:
            _libproc = ctypes.CDLL(ctypes.util.find_library("proc") or "libproc.dylib")
        info = _RUsageInfoV0()
        if _libproc.proc_pid_rusage(ctypes.c_int(pid), ctypes.c_int(0), ctypes.byref(info)) != 0:
            return None
        return int(info.ri_phys_footprint)
    except (OSError, AttributeError):
        return None
