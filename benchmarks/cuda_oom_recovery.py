"""A real CUDA out-of-memory inside a step, recovered in place (issue 38). Run on a GPU host with
MLX's CUDA backend, from the repository root:

    python benchmarks/cuda_oom_recovery.py [--model PATH] [--modes streaming,resident]
        [--point router|fence|eval|chunk] [--after 30] [--keep DIR]

For each mode it starts `moed serve` on a test checkpoint (tests/fixtures/checkpoints.py's tiny
float32 qwen3_moe, or --model) with the fault `overcommit_at_<point>=<after>`: once the daemon has
sent that many tokens, the next sync point of that kind allocates twice the GPU's memory inside the
step (daemon/engine/overcommit.py), so MLX's own allocator fails for real (`cudaMallocAsync(&data,
size, stream) failed: out of memory`); nothing is injected but the allocation. Three streams run
at once (greedy, seeded sampling, a long prompt), then the checks:

- every stream ends `done` with exactly the tokens of a clean daemon's uninterrupted run,
- the same pid and boot id, the model loaded once (status `loads`), one recovery from
  `out_of_memory` whose message is MLX's CUDA one, the expert budget (streaming) or the prompt
  chunk's ceiling (resident) lower, state `ready`,
- and the recovered daemon serves the same three streams again, identically (the device is sound).

It prints one PASS/FAIL line per check and a summary; exit 0 when every check passed, 1 when one
failed, 2 when this is not a CUDA host (nothing is run then). `--dry-run-inject cuda_oom` checks the
script itself anywhere, with MLX's message injected instead of a real allocation (says so).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from moed.client import Client, DaemonUnavailable, DoneEvent, RequestFailed, TokenEvent

REPO = Path(__file__).resolve().parents[1]


def ids(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 200 + 3 for i in range(n)]


STREAMS = [
    {"prompt_ids": ids(7, 1), "max_tokens": 48},
    {"prompt_ids": ids(11, 5), "max_tokens": 48, "temperature": 1.0, "top_p": 0.9, "seed": 11},
    {"prompt_ids": ids(90, 4), "max_tokens": 48},
]
MODES = {"streaming": ("--cache-budget", "25%"), "resident": ("--resident",)}
DEFAULT_POINT = {"streaming": "router", "resident": "eval"}


def require_cuda() -> None:
    """Fail loudly off CUDA: the point is MLX's CUDA allocator running out for real."""
    available = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    device = mx.default_device()
    if not available or device.type != mx.DeviceType.gpu:
        print(
            "FAIL: not a CUDA host. This benchmark needs MLX's CUDA backend "
            f"(mlx {getattr(mx, '__version__', '?')}, mx.cuda.is_available() = {available}, "
            f"default device {device}). Install mlx[cuda] on a machine with an NVIDIA GPU.",
            file=sys.stderr,
        )
        sys.exit(2)


class Daemon:
    """`moed serve` in its own folder; stopped (and waited for) by stop()."""

    def __init__(self, root: Path, model: Path, args: tuple[str, ...], faults: str):
        root.mkdir(parents=True, exist_ok=True)
        # A short socket path: AF_UNIX paths are limited to about 100 bytes.
        self.socket = Path(tempfile.mkdtemp(prefix="moed-oom-", dir="/tmp")) / "d.sock"
        self.log = root / "daemon.log"
        env = {**os.environ, "MOED_LOG_DIR": str(root / "logs"), "MOED_PREFILL_CHUNK": "16"}
        if faults:
            env["MOED_DEBUG_FAULTS"] = faults
        cmd = [sys.executable, "-m", "moed.daemon.cli", "serve", "--model", str(model)]
        cmd += ["--socket", str(self.socket), "--state-dir", str(root / "state"), *args]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moed serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with Client(self.socket, timeout=2.0) as c:
                    status = c.status()
                if status["state"] == "ready":
                    return status
            except DaemonUnavailable:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"no ready daemon in {timeout_s:.0f} s:\n{self.tail()}")

    def status(self) -> dict:
        with Client(self.socket, timeout=10.0) as c:
            return c.status()

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                with Client(self.socket, timeout=5.0) as c:
                    c.shutdown("cuda_oom_recovery done")
                self.proc.wait(30)
            except (DaemonUnavailable, RequestFailed, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        shutil.rmtree(self.socket.parent, ignore_errors=True)


def three_streams(socket: Path) -> list[tuple[list[int], object]]:
    """The three streams at once, each from its own client: (tokens, end event or error)."""
    results: list[tuple[list[int], object]] = [([], None)] * len(STREAMS)
    ready = threading.Barrier(len(STREAMS))

    def worker(n: int) -> None:
        got: list[int] = []
        end: object = None
        try:
            with Client(socket, timeout=120.0) as c:
                c.connect()
                ready.wait()
                for event in c.generate(**STREAMS[n]):
                    if isinstance(event, TokenEvent):
                        got += event.ids
                    elif isinstance(event, DoneEvent):
                        end = event
        except (RequestFailed, DaemonUnavailable) as exc:
            end = exc
        results[n] = (got, end)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(len(STREAMS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


class Checks:
    def __init__(self, mode: str):
        self.mode = mode
        self.failed = 0
        self.passed = 0

    def check(self, ok: bool, what: str, detail: object = "") -> None:
        self.passed += bool(ok)
        self.failed += not ok
        tail = f"  ({detail})" if detail != "" else ""
        print(f"  {'PASS' if ok else 'FAIL'}  {self.mode}: {what}{tail}", flush=True)


def run_mode(mode: str, fault: str, point: str, after: int, model: Path, root: Path) -> Checks:
    checks = Checks(mode)
    args = MODES[mode]
    spec = f"{fault}_at_{point}={after}"
    print(f"\n== {mode}: {spec} ==", flush=True)
    clean = Daemon(root / f"{mode}-clean", model, args, "")
    try:
        clean.wait_ready()
        expected = three_streams(clean.socket)
    finally:
        clean.stop()
    checks.check(
        all(isinstance(end, DoneEvent) for _, end in expected),
        "the clean daemon's run ends done",
        [type(end).__name__ for _, end in expected],
    )
    daemon = Daemon(root / mode, model, args, spec)
    try:
        before = daemon.wait_ready()
        got = three_streams(daemon.socket)
        alive = daemon.proc.poll() is None
        checks.check(alive, "the daemon process is still running", f"pid {before['pid']}")
        if not alive:
            print(daemon.tail(), flush=True)
            return checks
        try:
            after_status = daemon.status()
        except DaemonUnavailable as exc:  # the daemon went after the streams: say why
            checks.check(False, "the recovered daemon answers status", exc)
            print(daemon.tail(), flush=True)
            return checks
        again = three_streams(daemon.socket)
    finally:
        daemon.stop()
    ends = [type(end).__name__ for _, end in got]
    checks.check(all(isinstance(end, DoneEvent) for _, end in got), "all three end done", ends)
    checks.check(
        [t for t, _ in got] == [t for t, _ in expected],
        "tokens identical to an uninterrupted run",
        [len(t) for t, _ in got],
    )
    checks.check(
        (after_status["pid"], after_status["boot_id"]) == (before["pid"], before["boot_id"]),
        "same pid and boot id",
        f"pid {before['pid']} -> {after_status['pid']}",
    )
    checks.check(after_status.get("loads") == 1, "the model loaded once", after_status.get("loads"))
    recoveries = after_status.get("recoveries") or {}
    one = recoveries.get("out_of_memory") == 1
    checks.check(one, "one recovery from out_of_memory", recoveries)
    last = after_status.get("last_recovery") or {}
    message = str(last.get("message", ""))
    checks.check("out of memory" in message, "MLX's own CUDA out-of-memory message", message[:160])
    checks.check(last.get("phase") == "recovered", "the recovery finished", last.get("phase"))
    if mode == "streaming":
        was, now = before["streaming"]["budget_bytes"], after_status["streaming"]["budget_bytes"]
        checks.check(now < was, "the expert budget is lower", f"{was} -> {now} bytes")
    else:
        limit = after_status.get("prompt_chunk_limit")
        checks.check(limit is not None, "the prompt chunk's ceiling is lower", limit)
    checks.check(after_status.get("state") == "ready", "state ready", after_status.get("state"))
    checks.check(
        [t for t, _ in again] == [t for t, _ in expected],
        "the recovered daemon serves the same streams again, identically",
    )
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: a tiny one)")
    parser.add_argument("--modes", default="streaming,resident")
    parser.add_argument("--point", choices=("router", "fence", "eval", "chunk"))
    parser.add_argument("--after", type=int, default=30, help="tokens before the overcommit")
    parser.add_argument("--keep", type=Path, help="keep logs and state here")
    parser.add_argument(
        "--dry-run-inject",
        metavar="MESSAGE",
        help="check this script off CUDA: raise an injected message (ground/faults.py, e.g. "
        "cuda_oom) instead of the real allocation; no evidence of a real out-of-memory",
    )
    args = parser.parse_args()
    fault = "overcommit"
    if args.dry_run_inject:
        fault = args.dry_run_inject
        print(f"DRY RUN: {fault} is injected, not a real CUDA out-of-memory", flush=True)
    else:
        require_cuda()
    version = getattr(mx, "__version__", "?")
    print(f"mlx {version}, device {mx.default_device()}, {mx.device_info()}")
    root = args.keep or Path(tempfile.mkdtemp(prefix="moed-cuda-oom-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(REPO))  # tests/fixtures: the tiny checkpoint writer
        from tests.fixtures.checkpoints import write_checkpoint

        model = write_checkpoint(root / "qwen3_moe", "qwen3_moe")
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        point = args.point or DEFAULT_POINT[mode]
        results.append(run_mode(mode, fault, point, args.after, model, root))
    failed = sum(c.failed for c in results)
    passed = sum(c.passed for c in results)
    verdict = "PASS" if failed == 0 and passed else "FAIL"
    if args.dry_run_inject:
        verdict += " (dry run: injected, not a real out-of-memory)"
    print(f"\n{verdict}: {passed} checks passed, {failed} failed (logs under {root})")
    return 0 if failed == 0 and passed else 1


if __name__ == "__main__":
    sys.exit(main())
