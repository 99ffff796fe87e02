"""The macOS probe's parsers against sysctl output recorded on real Macs (tests/data/macos_*.txt).

sysctl(8) prints vm.swapusage as "total = %.2fM  used = %.2fM  free = %.2fM  %s" (the last field
"(encrypted)" or empty); `-n` drops the "name: " prefix. The pressure level is 1, 2 or 4.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from moed.daemon.platform import PressureLevel, macos

DATA = Path(__file__).parents[1] / "data"
MIB = 1024 * 1024


def _read(name: str) -> str:
    return (DATA / name).read_text()


@pytest.mark.parametrize(
    "name, total_mib, used_mib, free_mib, encrypted",
    [
        ("macos_swapusage.txt", 1024.00, 407.50, 616.50, True),
        ("macos_swapusage_heavy.txt", 11264.00, 9652.19, 1611.81, True),
        ("macos_swapusage_empty.txt", 0.0, 0.0, 0.0, True),
        ("macos_swapusage_n.txt", 7168.00, 6119.06, 1048.94, True),
        ("macos_swapusage_unencrypted.txt", 10240.00, 9105.88, 1134.12, False),
    ],
)
def test_parse_recorded_swapusage(name, total_mib, used_mib, free_mib, encrypted):
    usage = macos.parse_swapusage(_read(name))
    assert usage.total_bytes == round(total_mib * MIB)
    assert usage.used_bytes == round(used_mib * MIB)
    assert usage.free_bytes == round(free_mib * MIB)
    assert usage.encrypted is encrypted
    # sysctl prints used and free from the same snapshot: they add up to the total (to rounding).
    assert abs(usage.used_bytes + usage.free_bytes - usage.total_bytes) <= 0.02 * MIB


@pytest.mark.parametrize(
    "name, level",
    [
        ("macos_pressure_normal.txt", PressureLevel.NORMAL),
        ("macos_pressure_critical.txt", PressureLevel.CRITICAL),
        ("macos_pressure_warn_n.txt", PressureLevel.WARN),
    ],
)
def test_parse_recorded_pressure_level(name, level):
    assert macos.parse_pressure_level(_read(name)) is level


def test_unexpected_pressure_value_is_unknown():
    assert (
        macos.parse_pressure_level("kern.memorystatus_vm_pressure_level: 0\n")
        is PressureLevel.UNKNOWN
    )


@pytest.mark.parametrize(
    "text", ["", "sysctl: unknown oid 'vm.swapusage'", "total = 1.00M  used = 0.50M"]
)
def test_garbage_swapusage_is_refused(text):
    with pytest.raises(ValueError):
        macos.parse_swapusage(text)


def test_garbage_pressure_is_refused():
    with pytest.raises(ValueError):
        macos.parse_pressure_level("sysctl: unknown oid 'kern.memorystatus_vm_pressure_level'")


def test_probe_reads_through_sysctl(monkeypatch):
    # The probe runs sysctl and parses what it prints; here sysctl's stdout is the recorded text.
    outputs = {
        "vm.swapusage": _read("macos_swapusage_heavy.txt"),
        "kern.memorystatus_vm_pressure_level": _read("macos_pressure_critical.txt"),
    }
    monkeypatch.setattr(macos, "_sysctl", lambda name: outputs[name])
    probe = macos.MacOSProbe()
    assert probe.swap_used_bytes() == round(9652.19 * MIB)
    assert probe.pressure_level() is PressureLevel.CRITICAL


@pytest.mark.process
def test_probe_degrades_when_sysctl_fails(monkeypatch):
    def fail(name):
        raise subprocess.CalledProcessError(1, ["sysctl", name])

    monkeypatch.setattr(macos, "_sysctl", fail)
    probe = macos.MacOSProbe()
    assert probe.swap_used_bytes() is None
    assert probe.pressure_level() is PressureLevel.UNKNOWN
