"""A SIGTERM during the daemon's teardown keeps its exit code: Python restores SIGTERM's default
action early in finalization, and freeing a model can take a second after "moed exiting with code
N" (a watchdog's next step lands there). runtime/main.py ignores SIGTERM once the code is
decided."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process

CHILD = """
import signal, sys, time
from moed.daemon.runtime.main import _hold_exit_code

class SlowTeardown:  # freed with the module's globals, after Python reset its signal handlers
    def __del__(self):
        print("tearing down", flush=True)
        time.sleep(1.0)

slow = SlowTeardown()
signal.signal(signal.SIGTERM, lambda *_: None)  # as Server.install_signal_handlers does
if sys.argv[1] == "hold":
    _hold_exit_code()
sys.exit(5)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
# "plain" is the bug this guards against: without the hold, the SIGTERM kills the teardown.
@pytest.mark.parametrize(("mode", "expected"), [("hold", 5), ("plain", -signal.SIGTERM)])
def test_sigterm_in_teardown_keeps_the_exit_code(mode, expected):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "tearing down"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == expected
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
