"""The swap guard against real memory: a swap file, a memory cgroup, a hog that swaps for real.

Root only (swapon, cgroups). Everything made here is undone in `finally` blocks: the hog and
readers are killed, the cgroups removed, swap turned off and the swap file deleted.

- A hog confined by a cgroup memory limit well below its allocation pushes its pages to swap;
  the `moed watchdog` process sees swap grow and escalates against the real daemon: shed the
  cache, cancel the newest request, graceful shutdown, each within a bounded time.
- Page-cache churn (a reader streaming a file several times larger than its cgroup's limit):
  the cgroup's memory fills with cache and is reclaimed over and over, swap stays flat, and the
  watchdog does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moed.client import RequestFailed, TokenEvent
from moed.daemon.ground.watchdog_state import read_state
from moed.daemon.watchdog.events import read_events
from tests.fixtures.cgroups import MemoryCgroup
from tests.fixtures.daemon_harness import start_daemon, start_watchdog, stop_process

pytestmark = [
    pytest.mark.serial,
    pytest.mark.process,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="swap files and cgroups are Linux"
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="swapon and cgroups need root"),
    pytest.mark.timeout(180),
]

MIB = 1024 * 1024
SWAP_MB = 1536
CGROUP_LIMIT_MB = 256
HOG_MB = 1024  # ~770 MiB of it must go to swap: enough fresh growth for three steps
CHURN_FILE_MB = 1024

# The watchdog, tuned for a test: sample fast, act on small growth, short grace between steps.
WATCHDOG_ARGS = [
    "--interval",
    "0.2",
    "--consecutive",
    "2",
    "--swap-growth-mb",
    "64",
    "--step-grace",
    "0.5",
    "--progress-timeout",
    "600",
]

# Paced (about 270 MiB/s, so 1 GiB takes 4 s): each of the watchdog's three steps needs fresh
# growth after the one before it, and a hog done in 1.2 s (CI, once) left the last with none.
HOG = """
import sys, time
sys.stdin.readline()  # wait until the test has moved us into the cgroup
chunk, held = 16 << 20, []
for i in range(int(sys.argv[1]) // 16):
    block = bytearray(chunk)
    block[::4096] = b"\\1" * (chunk // 4096)  # touch every page so it is really charged
    held.append(block)
    time.sleep(0.06)
print("allocated", flush=True)
sys.stdin.readline()  # hold it until told (or killed)
"""

READER = """
import os, sys
sys.stdin.readline()
path, rounds = sys.argv[1], int(sys.argv[2])
for _ in range(rounds):
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
print("read", flush=True)
"""


# --- swap and cgroups -----------------------------------------------------------------------------


def _swap_used() -> int:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        info[name] = int(rest.split()[0]) * 1024
    return info["SwapTotal"] - info["SwapFree"]


def _swapoff_stale() -> None:
    """A run killed before its `finally` (SIGKILL, a timeout) leaves its swap file on: off now."""
    for line in Path("/proc/swaps").read_text().splitlines()[1:]:
        name = line.split()[0]
        if name.endswith("/moed-test.swap"):
            subprocess.run(["swapoff", name], capture_output=True)


@pytest.fixture(scope="module")
def swap_file(tmp_path_factory):
    _swapoff_stale()
    path = tmp_path_factory.mktemp("swap") / "moed-test.swap"
    active = False
    # A SIGTERM (a CI timeout) unwinds through the finally below instead of leaving swap on.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        try:
            subprocess.run(
                ["fallocate", "-l", f"{SWAP_MB}M", str(path)], check=True, capture_output=True
            )
            os.chmod(path, 0o600)
            subprocess.run(["mkswap", str(path)], check=True, capture_output=True)
            subprocess.run(["swapon", str(path)], check=True, capture_output=True)
            active = True
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            pytest.skip(
                f"cannot enable a swap file here ({exc}; {detail.decode(errors='replace').strip()})"
            )
        yield path
    finally:
        if active:
            for _ in range(5):
                if subprocess.run(["swapoff", str(path)], capture_output=True).returncode == 0:
                    break
                time.sleep(1.0)
        path.unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, previous)


def _start_in_cgroup(cg: MemoryCgroup, script: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    cg.add(proc.pid)  # before it allocates anything: it waits for a line on stdin
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return proc


# --- the daemon and the watchdog ------------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path, tiny_model):
    d = start_daemon(tmp_path / "daemon", tiny_model, "--resident")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def watchdog_process(tmp_path):
    started: list[subprocess.Popen] = []

    def start(daemon) -> tuple[subprocess.Popen, Path]:
        state_dir = tmp_path / "watchdog"
        proc = start_watchdog(daemon.socket, state_dir, tmp_path / "watchdog.log", *WATCHDOG_ARGS)
        started.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # running once it has published a state with a baseline
            state = read_state(state_dir)
            if state and (state.get("readings") or {}).get("swap_baseline_mb") is not None:
                return proc, state_dir
            assert proc.poll() is None, (tmp_path / "watchdog.log").read_text()
            time.sleep(0.1)
        raise TimeoutError("the watchdog did not start")

    try:
        yield start
    finally:
        for proc in started:
            stop_process(proc, 10)


def _actions(state_dir: Path) -> list[dict]:
    return [e for e in read_events(state_dir / "watchdog.jsonl") if e["event"] == "action"]


# --- tests ----------------------------------------------------------------------------------------


def test_swapping_hog_makes_the_watchdog_escalate(
    swap_file, memory_cgroup, daemon, watchdog_process
):
    _, state_dir = watchdog_process(daemon)
    cg = memory_cgroup(CGROUP_LIMIT_MB * MIB, swap=True)

    # A long generation in flight, so that "cancel the newest request" has something to cancel.
    outcome: dict = {}

    def generate():
        try:
            with daemon.client() as c:
                for event in c.generate("hello", max_tokens=8000, raw=True):
                    if isinstance(event, TokenEvent):
                        outcome["tokens"] = outcome.get("tokens", 0) + 1
            outcome["done"] = True
        except RequestFailed as exc:
            outcome["error"] = exc

    gen = threading.Thread(target=generate, daemon=True)
    gen.start()
    hog = None
    try:
        swap_before = _swap_used()
        t0 = time.monotonic()
        hog = _start_in_cgroup(cg, HOG, str(HOG_MB))
        wanted = ["shed_cache", "shed_cancel_newest", "shutdown"]
        seen: dict[str, float] = {}
        deadline = t0 + 60
        while time.monotonic() < deadline and len(seen) < len(wanted):
            for event in _actions(state_dir):
                seen.setdefault(event["action"], time.monotonic() - t0)
            time.sleep(0.05)
        events = _actions(state_dir)
        assert [e["action"] for e in events[:3]] == wanted, events
        swapped = _swap_used() - swap_before
        print(
            "\nescalation after the hog started: "
            f"{', '.join(f'{a} {t:.2f}s' for a, t in seen.items())}; "
            f"swap grew {swapped / MIB:.0f} MiB"
        )
        for e in events[:3]:
            assert e["rule"] == "memory" and e["outcome"]["ok"], e
            assert e["readings"]["swap_growth_mb"] >= 64, e
        # The graceful shutdown was honoured: the daemon drains and exits 5 so the service manager
        # restarts it with a backed-off budget.
        assert daemon.proc.wait(30) == 5
        gen.join(30)
        cancel = events[1]
        if cancel["readings"]["daemon"]["active_requests"]:
            assert outcome["error"].code.value == "out_of_memory", outcome
        state = read_state(state_dir)
        assert state["last_action"]["action"] in ("shutdown", "sigterm", "sigkill")
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def test_page_cache_churn_triggers_nothing(
    swap_file, memory_cgroup, daemon, watchdog_process, tmp_path
):
    # A file four times the cgroup's limit, its pages evicted so that the reader must fault them in.
    data = tmp_path / "big.bin"
    block = os.urandom(16 * MIB)
    with open(data, "wb") as f:
        for _ in range(CHURN_FILE_MB // 16):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    _, state_dir = watchdog_process(daemon)
    cg = memory_cgroup(CGROUP_LIMIT_MB * MIB, swap=True)
    reader = None
    try:
        swap_before = _swap_used()
        reader = _start_in_cgroup(cg, READER, str(data), "2")
        assert reader.stdout.readline().strip() == "read"
        assert reader.wait(60) == 0
        time.sleep(1.0)  # a few more samples after the churn
        peak = cg.peak_bytes()
        print(
            f"\npage-cache churn: read {2 * CHURN_FILE_MB} MiB "
            f"through a {CGROUP_LIMIT_MB} MiB cgroup, "
            f"peak {None if peak is None else peak // MIB} MiB, "
            f"swap delta {(_swap_used() - swap_before) / MIB:.1f} MiB"
        )
        if peak is not None:
            assert peak >= 0.8 * cg.limit_bytes  # the cache really filled the cgroup
        assert _swap_used() - swap_before < 64 * MIB
        assert _actions(state_dir) == []
        state = read_state(state_dir)
        assert (
            state["running"]
            and state["last_action"] is None
            and state["state"] in ("ok", "suspect")
        )
        assert daemon.proc.poll() is None
    finally:
        if reader is not None:
            reader.kill()
            reader.wait()
        data.unlink(missing_ok=True)
