"""`moed bench format` at toy scale: a real daemon, the real client, both sides measured, and the
plain rows of a mixed batch identical to the all-plain batch."""

from __future__ import annotations

import re

import pytest

from tests.fixtures.daemon_harness import moed

pytestmark = pytest.mark.process


def test_bench_format_prints_the_ratio_and_the_mixed_batch_check(tiny_model):
    out = moed(
        "bench",
        "format",
        "--model",
        str(tiny_model),
        "--clients",
        "2",
        "--max-tokens",
        "16",
        "--rounds",
        "1",
        "--cache-budget",
        "25%",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rate = re.search(r"decode tok/s per stream\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out.stdout)
    assert rate and all(float(v) > 0 for v in rate.groups()), out.stdout
    assert re.search(r"tokens per stream \(median\)\s+16\s+16", out.stdout), out.stdout
    assert "plain rows' tokens identical to the all-plain batch: True" in out.stdout
