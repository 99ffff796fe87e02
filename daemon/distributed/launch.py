"""Start the other ranks of a group and notice, within seconds, when one dies or stalls.

Rank 0 (the daemon) starts every other rank the way `mlx.launch` does: the same environment
(MLX_RANK, the JACCL variables, the hostfile's `envs`), locally as a child process or on another
host through `ssh`; the first line on each rank's stdin is the group's secret for the guard
(guard.py), which hands out the ring's addresses. Each rank writes a heartbeat line to its
stdout; rank 0 reads them. A rank whose process ended, or whose heartbeats stopped (a stalled or
frozen host), is a failed group: the daemon fails what is in flight and exits so the service
restarts the group.
A rank whose stdin closes (rank 0 is gone) exits by itself.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moed.daemon.distributed.hostfile import LOOPBACK, GroupSpec, RankHost
from moed.daemon.ground.exit_codes import PERMANENT_EXITS, DaemonExit
from moed.daemon.ground.open_files import restore_for_child

log = logging.getLogger("moed.distributed")

HEARTBEAT_S = 0.25  # how often a rank says it is alive
WAIT_LINE = b"wait"


def free_port_run(count: int, host: str = LOOPBACK, start: int = 0) -> int:
    """A first port such that `count` consecutive ports are free (the ring listens on each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, start))
            base = s.getsockname()[1]
        if base + count < 65536 and all(_free(host, base + i) for i in range(count)):
            return base
    raise OSError(f"no run of {count} free ports on {host}")


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def rank_environment(group: GroupSpec, rank: int, files_dir: Path) -> dict[str, str]:
    """The variables a rank's mx.distributed.init reads (files written under `files_dir`)."""
    env = {**group.rank_env(), "MLX_RANK": str(rank)}
    for name, content in group.rank_files().items():
        path = files_dir / f"{name.lower()}.json"
        path.write_text(content)
        env[name] = str(path)
    return env


def remote_script(group: GroupSpec, rank: int, argv: list[str]) -> str:
    """The shell line ssh runs on a remote host (mlx.launch writes its files the same way)."""
    parts = [f"export {k}={shlex.quote(v)};" for k, v in group.rank_env().items()]
    for name, content in group.rank_files().items():
        parts.append(f"f=$(mktemp); printf %s {shlex.quote(content)} > $f; export {name}=$f;")
    parts.append(f"export MLX_RANK={rank};")
    parts.append("exec " + shlex.join(argv))
    return " ".join(parts)


def ssh_command(host: RankHost, script: str) -> list[str]:
    # BatchMode: a missing key fails at once instead of waiting for a password nobody types.
    return ["ssh", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", host.ssh, script]


@dataclass(frozen=True)
class GroupFailure:
    reason: str
    exit_code: int  # what rank 0 exits with: RANK_FAILED (restart the group) or a final code


class RankProcess:
    """One started rank: its process and when it last said it was alive.

    Its beats are read by whoever asks for `failure` (the group monitor), from a non-blocking pipe:
    when rank 0 did not run for a while (its own ring init keeps the GIL, a starved CPU), the beats
    wait in the pipe and count as soon as it runs again, so silence is only ever real silence."""

    def __init__(self, rank: int, host: RankHost, popen: subprocess.Popen):
        self.rank = rank
        self.host = host
        self.popen = popen
        self.last_beat: float | None = None  # silence counts only once it has started beating
        self.formed_at: float | None = None  # the group's ring came up: its init is over
        self._pipe = popen.stdout.fileno()
        self._partial = b""
        os.set_blocking(self._pipe, False)

    def read_beats(self, now: float) -> None:
        while True:
            try:
                chunk = os.read(self._pipe, 65536)
            except BlockingIOError:
                return
            except OSError:
                return  # the rank closed its end: its exit is what counts now
            if not chunk:
                return
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for line in lines:
                # `wait`: the rank is inside mx.distributed.init, which holds the GIL while the
                # ring connects (retrying for seconds): starting again, only its exit counts.
                waits = line.strip() == WAIT_LINE and self.formed_at is None
                self.last_beat = None if waits else now
            if len(self._partial) > 64:
                self._partial = b"-"  # a long unfinished line is no `wait`: only that matters

    def group_formed(self, now: float) -> None:
        """Rank 0's ring is up, so this rank's init is done: its silence counts from now on,
        even if none of its beats since came through yet (a rank frozen right after the group
        formed was otherwise "still starting" for ever)."""
        self.formed_at = now

    def failure(self, timeout_s: float) -> GroupFailure | None:
        now = time.monotonic()
        self.read_beats(now)
        code = self.popen.poll()
        where = f"rank {self.rank} ({self.host.ssh or 'local'})"
        if code is not None:
            # A restart cannot help a rank that exited for good (a config it refuses, a plan that
            # does not fit): rank 0 exits with the same code, so the service leaves it down.
            final = code if code in PERMANENT_EXITS else DaemonExit.RANK_FAILED
            return GroupFailure(f"{where} exited with code {code}", final)
        last = self.last_beat if self.last_beat is not None else self.formed_at
        if last is None:
            return None  # still starting (imports, the ring's init): only its exit counts
        silent = now - max(last, self.formed_at or last)
        if silent > timeout_s:
            return GroupFailure(
                f"{where} stopped responding ({silent:.1f}s without a heartbeat)",
                DaemonExit.RANK_FAILED,
            )
        return None

    def stop(self, grace_s: float = 2.0) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.stdin.close()  # the rank exits by itself when rank 0 goes
            except OSError:
                pass
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class RankGroup:
    """Rank 0's view of the group: the ranks it started and a monitor thread watching them."""

    def __init__(self, group: GroupSpec, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s
        self.ranks: list[RankProcess] = []
        self.failure: GroupFailure | None = None
        self.on_failure: Callable[[GroupFailure], None] | None = None
        self._files = Path(tempfile.mkdtemp(prefix="moed-group-"))
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="moed-group", daemon=True)

    def start(self, spec_json: str, secret: bytes) -> None:
        """Set rank 0's own environment, start ranks 1..N-1 (each told the secret on its stdin,
        out of band: never in an argument or the environment), start watching them."""
        os.environ.update(rank_environment(self.group, 0, self._files))
        for host in self.group.hosts[1:]:
            if host.is_local:
                env = {**os.environ, **rank_environment(self.group, host.rank, self._files)}
                cmd = follower_argv(spec_json, host.rank)
            else:
                # Another host runs its own `moed` (same version, same model path): see README.
                argv = ["moed", "rank", "--spec", spec_json, "--rank", str(host.rank)]
                env, cmd = None, ssh_command(host, remote_script(self.group, host.rank, argv))
            popen = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,
                preexec_fn=restore_for_child,  # the open-file limit moed was started with
            )
            popen.stdin.write(secret.hex().encode() + b"\n")
            popen.stdin.flush()
            self.ranks.append(RankProcess(host.rank, host, popen))
            log.info("started rank %d on %s (pid %d)", host.rank, host.ssh or "local", popen.pid)
        self._monitor.start()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.1):
            now = time.monotonic()
            if now - last > self.timeout_s / 2:  # harmless (beats wait in the pipes); worth a line
                log.info("group monitor ran %.1fs late", now - last)
            last = now
            for rank in self.ranks:
                try:
                    failure = rank.failure(self.timeout_s)
                except Exception:  # a monitor that dies quietly would leave a frozen rank unseen
                    log.exception("checking rank %d failed", rank.rank)
                    continue
                if failure is not None:
                    self.failure = failure
                    log.error("pipeline group failed: %s", failure.reason)
                    if self.on_failure is not None:
                        self.on_failure(failure)
                    return

    def group_formed(self) -> None:
        """Rank 0's mx.distributed.init returned: every rank is past its own."""
        now = time.monotonic()
        for rank in self.ranks:
            rank.group_formed(now)

    @property
    def files(self) -> Path:
        return self._files

    def stop(self) -> None:
        self._stop.set()
        for rank in self.ranks:
            rank.stop()
        shutil.rmtree(self._files, ignore_errors=True)


def follower_argv(spec_json: str, rank: int) -> list[str]:
    """How rank 0 starts a follower on this machine: the same interpreter and moed."""
    return [
        sys.executable,
        "-m",
        "moed.daemon.cli",
        "rank",
        "--spec",
        spec_json,
        "--rank",
        str(rank),
    ]


def read_secret(stream) -> bytes:
    """The group's secret: the first line rank 0 writes on a follower's stdin."""
    line = stream.readline(256).strip()
    try:
        secret = bytes.fromhex(line.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) < 16:
        raise ValueError("no group secret on stdin: a rank is started by rank 0, never by hand")
    return secret


class Heartbeat:
    """A follower's side: beats on stdout; exits the process when stdin closes (rank 0 is gone)."""

    def __init__(self) -> None:
        self._beat = threading.Thread(target=self._run_beat, name="beat", daemon=True)
        self._orphan = threading.Thread(target=self._watch_parent, name="parent", daemon=True)
        self._lock = threading.Lock()
        self._held = False

    def start(self) -> None:
        self._beat.start()
        self._orphan.start()

    def hold(self) -> None:
        """Before a call that keeps the GIL (the ring's connect): say so, then stop beating."""
        with self._lock:
            self._held = True
            self._write(WAIT_LINE + b"\n")

    def resume(self) -> None:
        with self._lock:
            self._held = False
            # A beat now, from the thread that just left init: the beat thread may not run for a
            # while (this process's GIL), and rank 0 hears this rank is serving at once.
            self._write(b".\n")

    def _write(self, line: bytes) -> None:
        out = sys.stdout.buffer
        try:
            out.write(line)
            out.flush()
        except (BrokenPipeError, ValueError, OSError):
            os._exit(0)

    def _run_beat(self) -> None:
        while True:
            with self._lock:
                if not self._held:
                    self._write(b".\n")
            time.sleep(HEARTBEAT_S)

    def _watch_parent(self) -> None:
        while sys.stdin.buffer.read(4096):
            pass
        log.info("rank 0 went away: exiting")
        os._exit(0)
