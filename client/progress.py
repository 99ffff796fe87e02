"""Progress for long work where a user is looking: a bar on a terminal, JSON lines for scripts,
nothing otherwise (a log file or a pipe gets no carriage-return noise). Imports no mlx."""

from __future__ import annotations

import enum
import json
import sys
import time
from typing import IO, Any

from moed.protocol.units import format_bytes


class ProgressMode(str, enum.Enum):
    OFF = "off"  # not a terminal and no --json: silent
    BAR = "bar"  # a tqdm bar on stderr
    JSON = "json"  # one {"type": "progress", ...} object per line on stdout


class Unit(str, enum.Enum):
    BYTES = "bytes"
    STEPS = "steps"
    TOKENS = "tokens"


def progress_mode(as_json: bool, stream: IO[str] | None = None) -> ProgressMode:
    if as_json:
        return ProgressMode.JSON
    stream = stream or sys.stderr
    return ProgressMode.BAR if _isatty(stream) else ProgressMode.OFF


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# JSON events at most this often (plus the first and the last): a pull of 70 GB is not a flood.
JSON_EVERY_S = 0.25


class Progress:
    """One task's progress. `update` takes the absolute amount done; `total` may come later."""

    def __init__(
        self,
        task: str,
        mode: ProgressMode,
        total: float | None = None,
        unit: Unit = Unit.STEPS,
        out: IO[str] | None = None,
    ):
        self.task, self.mode, self.total, self.unit = task, mode, total, unit
        self.done = 0.0
        self.detail: str | None = None
        self._out = out
        self._last_json = 0.0
        self._last_event: dict[str, Any] | None = None
        self._bar = None
        if mode is ProgressMode.BAR:
            from tqdm import tqdm  # imported only when a bar is drawn: `moe --help` stays fast

            self._bar = tqdm(
                total=total,
                desc=task,
                unit="B" if unit is Unit.BYTES else "",
                unit_scale=unit is Unit.BYTES,
                unit_divisor=1000,  # decimal units, as everywhere else in moed
                file=out or sys.stderr,
                leave=True,
                dynamic_ncols=True,
                # No total (waiting for a daemon to answer): the time spent, not a rate of nothing.
                bar_format=None if total is not None else "{desc} [{elapsed}]",
            )
        self._emit(force=True)

    def update(
        self,
        done: float,
        total: float | None = None,
        detail: str | None = None,
        stage: str | None = None,
    ) -> None:
        if stage is not None and stage != self.task:
            self.task = stage
            if self._bar is not None:
                self._bar.set_description_str(stage, refresh=False)
        if total is not None and total != self.total:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
                self._bar.bar_format = None  # now there is a bar to draw
        if detail is not None:
            self.detail = detail
            if self._bar is not None:
                self._bar.set_postfix_str(detail, refresh=False)
        delta = done - self.done
        self.done = done
        if self._bar is not None:
            self._bar.update(delta)
        self._emit(force=False)

    def advance(self, n: float, detail: str | None = None) -> None:
        self.update(self.done + n, detail=detail)

    def close(self, done: bool = True) -> None:
        if done and self.total is not None:
            self.update(self.total)
        self._emit(force=True, final=True)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: Any) -> None:
        self.close(done=exc_type is None)

    def _emit(self, force: bool, final: bool = False) -> None:
        if self.mode is not ProgressMode.JSON:
            return
        now = time.monotonic()
        if not force and now - self._last_json < JSON_EVERY_S:
            return
        event = {
            "type": "progress",
            "task": self.task,
            "done": self.done,
            "total": self.total,
            "unit": self.unit.value,
        }
        if self.detail:
            event["detail"] = self.detail
        if final:
            event["final"] = True
        if event == self._last_event:  # nothing moved (a daemon not answering yet): no new line
            return
        self._last_json, self._last_event = now, event
        out = self._out or sys.stdout
        out.write(json.dumps(event) + "\n")
        out.flush()


def describe(done: float, total: float | None, unit: Unit) -> str:
    """`1.2 GB of 17.0 GB` or `3 of 40`: for one-line notes."""
    if unit is Unit.BYTES:
        return f"{format_bytes(done)} of {format_bytes(total)}" if total else format_bytes(done)
    return f"{done:.0f} of {total:.0f}" if total else f"{done:.0f}"


class StagedProgress:
    """Progress through named stages (a model load: reading, weights in bytes, warming): each
    stage gets its own bar (or its own JSON task), since their units differ."""

    def __init__(self, prefix: str, mode: ProgressMode, out: IO[str] | None = None):
        self.prefix, self.mode, self._out = prefix, mode, out
        self.stage: str | None = None
        self._current: Progress | None = None

    def update(self, stage: str, done: float, total: float | None, unit: str) -> None:
        if stage != self.stage:
            self.close()
            self.stage = stage
            known = unit in Unit._value2member_map_
            self._current = Progress(
                f"{self.prefix}: {stage}",
                self.mode,
                total=total,
                unit=Unit(unit) if known else Unit.STEPS,
                out=self._out,
            )
        assert self._current is not None
        self._current.update(done, total)

    def close(self, done: bool = True) -> None:
        if self._current is not None:
            self._current.close(done)
            self._current = None
        self.stage = None  # the same stage may come again (a resumed request reads its prompt)
