"""Fault injection for tests: `ServeConfig.debug_faults`, empty (off) by default.

A comma-separated list of `<fault>_after=<N>`: once this process has produced N tokens, the next
engine step
- `oom_after`: raises the error MLX >= 0.32 raises after a Metal command-buffer failure,
- `abort_after`: aborts the process (SIGABRT, what older MLX does on a Metal OOM),
- `hang_after`: blocks the engine thread for good (the transport still answers pings),
- `step_error_after`: raises an ordinary error (a bug in a step, not a memory failure).

Two more act inside a prompt chunk's forward pass, layer by layer (engine/heartbeat.py calls them):
- `layer_delay_ms=<N>`: each decoder layer of a prompt chunk takes N ms longer (a slow, moving
  chunk: a model whose chunk outlasts the progress deadline),
- `layer_gil_ms=<N>`: the same, holding the GIL (a long native call that keeps it: the transport
  thread cannot answer pings meanwhile, as on a heavily loaded machine),
- `layer_hang_after=<N>`: after N layers of prompt chunks, the engine thread blocks for good inside
  a layer (a wedge in the middle of a step).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
import time
from dataclasses import dataclass, field

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
    LAYER_HANG = "layer_hang"  # counted in prompt-chunk layers, not tokens


_LAYER_FAULTS = frozenset({Fault.LAYER_HANG})


class LayerStall(str, enum.Enum):
    """How a prompt chunk's layer is slowed: `<name>_ms=N` in the spec."""

    DELAY = "layer_delay"  # sleeps: the engine is slow, the process answers
    GIL = "layer_gil"  # holds the GIL: every Python thread waits, the transport's too
    STEP = "step_delay"  # sleeps before every step, decode too: a request stays in flight


@dataclass(frozen=True)
class Faults:
    after: dict[Fault, int]
    layer_s: dict[LayerStall, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> Faults:
        after: dict[Fault, int] = {}
        layer_s: dict[LayerStall, float] = {}
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            name, _, value = item.partition("=")
            if not value.strip().isdigit() or not name.endswith(("_after", "_ms")):
                raise ValueError(
                    f"debug_faults: cannot parse {item!r} (use oom_after=N, abort_after=N, "
                    "hang_after=N, step_error_after=N, layer_hang_after=N, layer_delay_ms=N, "
                    "layer_gil_ms=N, step_delay_ms=N)"
                )
            try:
                if name.endswith("_ms"):
                    layer_s[LayerStall(name[: -len("_ms")])] = int(value) / 1000.0
                else:
                    after[Fault(name[: -len("_after")])] = int(value)
            except ValueError:
                raise ValueError(f"debug_faults: unknown fault {name!r}") from None
        return cls(after, layer_s)

    def __bool__(self) -> bool:
        return bool(self.after) or bool(self.layer_s)

    def in_layer(self, layers_so_far: int) -> None:
        """Called on the engine thread after each decoder layer of a prompt chunk."""
        if (delay := self.layer_s.get(LayerStall.DELAY)) is not None:
            time.sleep(delay)
        if (held := self.layer_s.get(LayerStall.GIL)) is not None:
            _sleep_holding_gil(held)
        n = self.after.get(Fault.LAYER_HANG)
        if n is not None and layers_so_far >= n:
            log.warning("debug fault layer_hang after %d prompt layers", n)
            threading.Event().wait()

    def before_step(self, tokens_so_far: int) -> None:
        """Called on the engine thread before each decoding step."""
        if (delay := self.layer_s.get(LayerStall.STEP)) is not None:
            time.sleep(delay)
        for fault, n in self.after.items():
            if tokens_so_far < n or fault in _LAYER_FAULTS:
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


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _sleep_holding_gil(seconds: float) -> None:
    """One libc nanosleep through ctypes.PyDLL, which keeps the GIL for the call: as a long native
    call that holds it, it starves every other Python thread of the process."""
    libc = ctypes.PyDLL(None)
    whole = int(seconds)
    libc.nanosleep(ctypes.byref(_Timespec(whole, int((seconds - whole) * 1e9))), None)
