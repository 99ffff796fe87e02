"""`moe run --trace FILE`: write the router-trace chunks a generation streams back into FILE."""

from __future__ import annotations

from pathlib import Path

import click

from .events import TraceEvent


class TraceFile:
    """Chunks arrive in order on one connection; each chunk ends on a record boundary, so a
    generation cut short still leaves a readable (shorter) trace."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "wb")
        self.bytes = 0
        self.chunks = 0

    def write(self, event: TraceEvent) -> None:
        if event.seq != self.chunks:
            raise click.ClickException(f"trace chunk {event.seq} arrived, expected {self.chunks}")
        self._f.write(event.data)
        self.bytes += len(event.data)
        self.chunks += 1

    def close(self) -> None:
        self._f.close()
        if self.chunks:
            click.echo(
                f"moe: router trace written to {self.path} ({self.bytes} bytes); "
                f"analyse it with `moed trace analyze {self.path}`",
                err=True,
            )
        else:
            click.echo(
                "moe: the daemon sent no trace "
                "(it keeps every expert resident: nothing is streamed)",
                err=True,
            )
