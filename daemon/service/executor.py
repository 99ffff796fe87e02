"""Every side effect of `moed service` goes through an Executor: it performs file writes and
commands, or in a dry run prints them (files as shell here-documents, commands as shell lines)."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from moed.daemon.ground.state_files import write_atomic

HEREDOC_END = "MOED_EOF"


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str = ""
    stderr: str = ""


class CommandFailed(RuntimeError):
    def __init__(self, argv: list[str], result: Result, hint: str = ""):
        detail = (result.stderr or result.stdout).strip()
        message = f"`{shlex.join(argv)}` exited {result.returncode}" + (
            f": {detail}" if detail else ""
        )
        super().__init__(message + (f"\n{hint}" if hint else ""))
        self.argv = argv
        self.result = result


class Executor:
    """Performs file writes and commands, or prints them when dry_run is set."""

    def __init__(self, dry_run: bool = False, echo: Callable[[str], None] = print):
        self.dry_run = dry_run
        self.echo = echo

    def write(self, path: Path, content: bytes, mode: int = 0o644) -> None:
        if self.dry_run:
            text = content.decode()
            self.echo(f"mkdir -p {shlex.quote(str(path.parent))}")
            self.echo(
                f"cat > {shlex.quote(str(path))} <<'{HEREDOC_END}'\n"
                f"{text.rstrip(chr(10))}\n{HEREDOC_END}"
            )
            return
        write_atomic(path, content)
        os.chmod(path, mode)

    def mkdir(self, path: Path) -> None:
        if self.dry_run:
            self.echo(f"mkdir -p {shlex.quote(str(path))}")
            return
        path.mkdir(parents=True, exist_ok=True)

    def remove(self, path: Path) -> None:
        if self.dry_run:
            self.echo(f"rm -f {shlex.quote(str(path))}")
            return
        path.unlink(missing_ok=True)

    def rmdir_if_empty(self, path: Path) -> None:
        if self.dry_run:
            self.echo(f"rmdir {shlex.quote(str(path))} 2>/dev/null || true")
            return
        try:
            path.rmdir()
        except OSError:
            pass  # not empty, or not there

    def run(
        self, argv: list[str], ok: Iterable[int] = (0,), tolerate: bool = False, hint: str = ""
    ) -> Result:
        """Run a command; a dry run prints it and reports success. tolerate: never raise."""
        if self.dry_run:
            self.echo(shlex.join(argv) + (" || true" if tolerate else ""))
            return Result(0)
        result = _capture(argv)
        if result.returncode not in set(ok) and not tolerate:
            raise CommandFailed(argv, result, hint)
        return result

    def query(self, argv: list[str]) -> Result | None:
        """A read-only command whose answer the caller needs: None in a dry run (after printing
        it)."""
        if self.dry_run:
            self.echo(shlex.join(argv))
            return None
        return _capture(argv)

    def foreground(self, argv: list[str]) -> int:
        """Hand the terminal to a command (logs -f): its output goes straight to ours."""
        return self.foreground_all([argv])

    def foreground_all(self, commands: list[list[str]]) -> int:
        """Hand the terminal to several commands at once (two log followers), until they end or
        Ctrl-C; the worst exit code."""
        if self.dry_run:
            for argv in commands:
                self.echo(shlex.join(argv))
            return 0
        procs: list[subprocess.Popen] = []
        try:
            for argv in commands:
                try:
                    procs.append(subprocess.Popen(argv))
                except FileNotFoundError:
                    result = Result(127, stderr=f"{argv[0]}: command not found")
                    raise CommandFailed(argv, result) from None
            return max(proc.wait() for proc in procs)
        except KeyboardInterrupt:
            return 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()


def _capture(argv: list[str]) -> Result:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return Result(127, stderr=f"{argv[0]}: command not found")
    return Result(proc.returncode, proc.stdout, proc.stderr)
