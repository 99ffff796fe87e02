"""The process's open-file limit: raised to what the machine allows when `moed` starts, kept through
mlx-lm's import (which sets it to (2048, 4096) whatever the machine allows, and raises ValueError
under a hard limit below 4096), and given back as it was to the processes moed starts.

Every client connection, expert shard and log is one descriptor; libzmq aborts the whole process
when it cannot accept one, so the daemon also counts its connections (transport/connections.py)
and refuses them well before the limit.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import resource
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger("moed")

# What mlx-lm's own import asks for ("for large models with lots of files"): below it a large
# checkpoint's shards, the client connections and libzmq's own descriptors do not fit.
MIN_OPEN_FILES = 2048
# Descriptors kept for everything but client connections: shards, logs, libzmq, the page cache
# probe, the prefetch workers' files.
RESERVED_FILES = 512
_OPEN_MAX_DARWIN = 10240  # macOS's OPEN_MAX: setrlimit refuses more when sysctl cannot be read


class OpenFileLimitTooLow(Exception):
    """The hard limit leaves too few descriptors; the message says how to raise it."""


@dataclass(frozen=True)
class OpenFileLimit:
    original: tuple[int, int]  # (soft, hard) when the process started: what children get
    soft: int  # the limit now

    @property
    def connection_room(self) -> int:
        """Client connections that fit beside the reserved descriptors."""
        return max(1, self.soft - RESERVED_FILES)


_limit: OpenFileLimit | None = None


def _candidates(hard: int) -> list[int]:
    """Limits to try, largest first: the hard limit, and on macOS the per-process maximum
    (setrlimit there refuses RLIM_INFINITY and anything above kern.maxfilesperproc)."""
    out = [] if hard == resource.RLIM_INFINITY else [hard]
    if sys.platform == "darwin":
        try:
            sysctl = ["sysctl", "-n", "kern.maxfilesperproc"]
            out.append(int(subprocess.run(sysctl, capture_output=True, timeout=5).stdout))
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
        out.append(_OPEN_MAX_DARWIN)
    if hard == resource.RLIM_INFINITY:
        out.append(1 << 20)
    return sorted({c for c in out if hard == resource.RLIM_INFINITY or c <= hard}, reverse=True)


def raise_open_file_limit() -> OpenFileLimit:
    """Raise the soft limit as far as the machine allows and keep it through mlx-lm's import.
    Called once at `moed` start, before anything imports mlx-lm; later calls return the first."""
    global _limit
    if _limit is not None:
        return _limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    now = soft
    for candidate in _candidates(hard):
        if candidate <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (candidate, hard))
        except (ValueError, OSError):
            continue
        now = candidate
        break
    _limit = OpenFileLimit((soft, hard), now)
    if "mlx_lm.utils" not in sys.modules:
        sys.meta_path.insert(0, _KeepLimitThroughImport())
    return _limit


def current() -> OpenFileLimit:
    if _limit is not None:
        return _limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OpenFileLimit((soft, hard), soft)


def require_open_files(minimum: int = MIN_OPEN_FILES) -> OpenFileLimit:
    limit = current()
    if limit.soft < minimum:
        _, hard = limit.original
        raise OpenFileLimitTooLow(
            f"the open-file limit is {limit.soft} (hard limit {hard}); moed serve needs at least "
            f"{minimum}: raise it (`ulimit -Hn {minimum}` as root, LimitNOFILE= in a systemd "
            "unit, HardResourceLimits/NumberOfFiles in a launchd plist)"
        )
    return limit


def restore_for_child() -> None:
    """A child process starts with the limit moed was given (a `preexec_fn`: no Python objects
    are made here, only one system call)."""
    if _limit is not None and _limit.soft != _limit.original[0]:
        resource.setrlimit(resource.RLIMIT_NOFILE, _limit.original)


@contextlib.contextmanager
def _keep_open_file_limit():
    real = resource.setrlimit

    def setrlimit(which, limits):
        if which == resource.RLIMIT_NOFILE:
            log.debug(
                "kept the open-file limit at %s (mlx-lm asked for %s)", current().soft, limits
            )
            return
        real(which, limits)

    resource.setrlimit = setrlimit
    try:
        yield
    finally:
        resource.setrlimit = real


class _KeepLimitThroughImport(importlib.abc.MetaPathFinder):
    """Runs mlx_lm/utils.py with its RLIMIT_NOFILE call kept from lowering moed's limit
    (model/mlx_compat.py, use 7)."""

    def find_spec(self, name, path, target=None):
        if name != "mlx_lm.utils":
            return None
        sys.meta_path.remove(self)  # once: the module is imported once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def guarded(module) -> None:
            with _keep_open_file_limit():
                exec_module(module)

        spec.loader.exec_module = guarded
        return spec
