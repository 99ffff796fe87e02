"""The Linux probe: /proc/meminfo swap and PSI pressure, from text and from the live system."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from moed.daemon.platform import PressureLevel, probe_for_platform
from moed.daemon.platform.linux import (
    PSI,
    LinuxProbe,
    level_from_psi,
    parse_psi,
    swap_used_from_meminfo,
)

MEMINFO = """\
MemTotal:       24598432 kB
MemFree:         1203400 kB
MemAvailable:   20100232 kB
Cached:         18233112 kB
SwapCached:        10240 kB
SwapTotal:       2097148 kB
SwapFree:        1572860 kB
HugePages_Total:       0
"""

PSI_CALM = (
    "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)
PSI_CHURN = (
    "some avg10=14.20 avg60=3.10 avg300=0.80 total=912345\n"
    "full avg10=2.10 avg60=0.40 avg300=0.10 total=123456\n"
)
PSI_THRASH = (
    "some avg10=88.50 avg60=41.00 avg300=9.00 total=99912345\n"
    "full avg10=71.30 avg60=30.00 avg300=6.00 total=81234567\n"
)


def test_swap_used_from_meminfo():
    assert swap_used_from_meminfo(MEMINFO) == (2097148 - 1572860) * 1024


def test_meminfo_without_swap_lines_is_refused():
    with pytest.raises(ValueError):
        swap_used_from_meminfo("MemTotal: 1 kB\n")


@pytest.mark.parametrize(
    "text, level",
    [
        (PSI_CALM, PressureLevel.NORMAL),
        (PSI_CHURN, PressureLevel.WARN),
        (PSI_THRASH, PressureLevel.CRITICAL),
    ],
)
def test_psi_levels(text, level):
    assert level_from_psi(parse_psi(text)) is level


def test_psi_without_full_line():
    psi = parse_psi("some avg10=1.50 avg60=0.00 avg300=0.00 total=10\n")
    assert psi == PSI(1.5, None)
    assert level_from_psi(psi) is PressureLevel.NORMAL


def _fake_proc(tmp_path: Path, psi: str | None) -> Path:
    (tmp_path / "meminfo").write_text(MEMINFO)
    if psi is not None:
        (tmp_path / "pressure").mkdir()
        (tmp_path / "pressure" / "memory").write_text(psi)
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(
        "Name:\tmoed\nState:\tS (sleeping)\nVmRSS:\t  204800 kB\nVmSwap:\t    1024 kB\n"
    )
    return tmp_path


def test_probe_on_a_proc_tree(tmp_path):
    probe = LinuxProbe(proc=_fake_proc(tmp_path, PSI_THRASH))
    assert probe.swap_used_bytes() == (2097148 - 1572860) * 1024
    assert probe.pressure_level() is PressureLevel.CRITICAL
    footprint = probe.process_footprint(42)
    assert footprint.resident_bytes == 204800 * 1024 and footprint.swap_bytes == 1024 * 1024
    assert probe.process_footprint(43) is None


def test_no_psi_means_unknown(tmp_path):
    assert LinuxProbe(proc=_fake_proc(tmp_path, None)).pressure_level() is PressureLevel.UNKNOWN


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads this machine's /proc")
def test_live_probe():
    probe = probe_for_platform()
    assert isinstance(probe, LinuxProbe)
    assert probe.swap_used_bytes() >= 0
    assert probe.pressure_level() in set(PressureLevel)
    me = probe.process_footprint(os.getpid())
    assert me.resident_bytes > 1024 * 1024
