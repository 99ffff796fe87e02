"""Fault injection for tests: `ServeConfig.debug_faults`, empty (off) by default.

A comma-separated list of `<fault>_after=<N>`: once this process has produced N tokens, the next
engine step
- `oom_after`: raises the error MLX >= 0.32 raises after a Metal command-buffer failure,
- `abort_after`: aborts the process (SIGABRT, what older MLX does on a Metal OOM),
- `hang_after`: blocks the engine thread for good (the transport still answers pings),
- `step_error_after`: raises an ordinary error (a bug in a step, not a memory failure).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger("moed.faults")

METAL_OOM_MESSAGE = (
    "[METAL] Command buffer execution failed: Insufficient Memory "
    "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"
)


class Fault(str, enum.Enum):
    OOM = "oom"
    ABORT = "abort"
    HANG = "hang"
    STEP_ERROR = "step_error"


@dataclass(frozen=True)
class Faults:
    after: dict[Fault, int]

    @classmethod
    def parse(cls, spec: str) -> Faults:
        after: dict[Fault, int] = {}
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            name, _, value = item.partition("=")
            if not name.endswith("_after") or not value.strip().isdigit():
                raise ValueError(
                    f"debug_faults: cannot parse {item!r} "
                    "(use oom_after=N, abort_after=N, hang_after=N, step_error_after=N)"
                )
            try:
                fault = Fault(name[: -len("_after")])
            except ValueError:
                raise ValueError(f"debug_faults: unknown fault {name!r}") from None
            after[fault] = int(value)
        return cls(after)

    def __bool__(self) -> bool:
        return bool(self.after)

    def before_step(self, tokens_so_far: int) -> None:
        """Called on the engine thread before each decoding step."""
        for fault, n in self.after.items():
            if tokens_so_far < n:
                continue
            log.warning("debug fault %s after %d tokens", fault.value, n)
            if fault is Fault.OOM:
                raise RuntimeError(METAL_OOM_MESSAGE)
            if fault is Fault.ABORT:
                os.abort()
            if fault is Fault.HANG:
                threading.Event().wait()
            if fault is Fault.STEP_ERROR:
                raise RuntimeError("debug fault: a step failed")
