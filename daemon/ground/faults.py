"""Fault injection for tests: `ServeConfig.debug_faults`, empty (off) by default.

A comma-separated list of `<fault>_after=<N>`: once this process has produced N tokens, every
later engine step
- `oom_after`: raises the error MLX >= 0.32 raises after a Metal command-buffer failure (at every
  step: the in-place recovery fails again, so the daemon takes the restart path),
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

Device failures at the real sync points, once each: `<message>_at_<point>=<N>` raises the message
MLX formats (DeviceMessage) at the first `point` (SyncPoint) reached after this process produced N
tokens, e.g. `metal_oom_at_router=30,metal_timeout_at_chunk=60`. `overcommit_at_<point>=<N>` is no
injected message: there the engine allocates more than the GPU holds, and MLX's own allocator
fails (engine/overcommit.py; refused on the CPU backend, where it would swap instead).

And one per stage of a request's text path (engine/text_path.py), for one hostile request among
others: `text_<stage>_after=<N>` (stage: detokenize, reasoning, stops, tool_calls, grammar,
logprobs) raises in that stage of a request whose prompt holds `HOSTILE_MARKER:<stage>`, once
the request has produced N tokens; that request fails alone, every other stream carries on.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("moed.faults")


class DeviceMessage(str, enum.Enum):
    """What a device fault raises: the messages MLX 0.32 formats (ground/device_errors.py)."""

    METAL_OOM = "metal_oom"
    METAL_MALLOC = "metal_malloc"
    CUDA_OOM = "cuda_oom"
    METAL_TIMEOUT = "metal_timeout"
    METAL_INTERACTIVITY = "metal_interactivity"
    METAL_INTERNAL = "metal_internal"  # a device error that is neither memory nor a timeout


# "[METAL] Command buffer execution failed: {}." (mlx/backend/metal/device.cpp) around Metal's
# descriptions; the allocators' own words (metal/allocator.cpp, cuda/allocator.cpp, cuda/utils.cpp).
DEVICE_MESSAGES: dict[DeviceMessage, str] = {
    DeviceMessage.METAL_OOM: "[METAL] Command buffer execution failed: Insufficient Memory "
    "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory).",
    DeviceMessage.METAL_MALLOC: "[malloc] Unable to allocate 17179869184 bytes.",
    DeviceMessage.CUDA_OOM: "cudaMallocAsync(&data, size, stream) failed: out of memory",
    DeviceMessage.METAL_TIMEOUT: "[METAL] Command buffer execution failed: Caused GPU Timeout "
    "Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout).",
    DeviceMessage.METAL_INTERACTIVITY: "[METAL] Command buffer execution failed: Impacting "
    "Interactivity (0000000e:kIOGPUCommandBufferCallbackErrorImpactingInteractivity).",
    DeviceMessage.METAL_INTERNAL: "[METAL] Command buffer execution failed: Internal Error "
    "(0000000a:Internal Error).",
}
METAL_OOM_MESSAGE = DEVICE_MESSAGES[DeviceMessage.METAL_OOM]


class SyncPoint(str, enum.Enum):
    """Where MLX raises a device failure: the host waits on the device there."""

    ROUTER = "router"  # a streamed layer's router read-back (experts/streamer.py)
    FENCE = "fence"  # the lazy fence evaluating outputs before a slot is overwritten
    EVAL = "eval"  # the step's final evaluation: its tokens read back (engine/batch.py)
    CHUNK = "chunk"  # a decoder layer's evaluation inside a prompt chunk (model/layer_progress.py)


@dataclass(frozen=True)
class DeviceFault:
    message: DeviceMessage | None  # None: `overcommit`, a real allocation over device memory
    point: SyncPoint
    after: int  # tokens this process produced before it fires


OVERCOMMIT = "overcommit"


class _Fired:
    """The running state of the device faults: tokens seen so far, which fired, and how an
    `overcommit` allocates (the engine's, with MLX: engine/overcommit.py)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.fired: set[DeviceFault] = set()
        self.overcommit: Callable[[], None] | None = None


class Fault(str, enum.Enum):
    OOM = "oom"
    ABORT = "abort"
    HANG = "hang"
    STEP_ERROR = "step_error"
    LAYER_HANG = "layer_hang"  # counted in prompt-chunk layers, not tokens


_LAYER_FAULTS = frozenset({Fault.LAYER_HANG})

# A prompt holding `HOSTILE_MARKER:<stage>` is one a `text_<stage>_after` fault hits.
HOSTILE_MARKER = "moed-hostile-request"


class TextStage(str, enum.Enum):
    """The stages between a row's sampled token and its client (engine/text_path.py)."""

    DETOKENIZE = "detokenize"
    REASONING = "reasoning"  # the think-marker channel split
    STOPS = "stops"
    TOOL_CALLS = "tool_calls"  # cutting out and parsing tool calls
    GRAMMAR = "grammar"  # advancing the row's grammar and masking its logits
    LOGPROBS = "logprobs"


class LayerStall(str, enum.Enum):
    """How a prompt chunk's layer is slowed: `<name>_ms=N` in the spec."""

    DELAY = "layer_delay"  # sleeps: the engine is slow, the process answers
    GIL = "layer_gil"  # holds the GIL: every Python thread waits, the transport's too
    STEP = "step_delay"  # sleeps before every step, decode too: a request stays in flight


@dataclass(frozen=True)
class Faults:
    after: dict[Fault, int]
    layer_s: dict[LayerStall, float] = field(default_factory=dict)
    device: tuple[DeviceFault, ...] = ()
    text_after: dict[TextStage, int] = field(default_factory=dict)
    _state: _Fired = field(default_factory=_Fired, compare=False, repr=False)

    @classmethod
    def parse(cls, spec: str) -> Faults:
        after: dict[Fault, int] = {}
        layer_s: dict[LayerStall, float] = {}
        device: list[DeviceFault] = []
        text_after: dict[TextStage, int] = {}
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            name, _, value = item.partition("=")
            name = name.strip()
            if not value.strip().isdigit() or not (
                name.endswith(("_after", "_ms")) or "_at_" in name
            ):
                raise ValueError(
                    f"debug_faults: cannot parse {item!r} (use oom_after=N, abort_after=N, "
                    "hang_after=N, step_error_after=N, layer_hang_after=N, layer_delay_ms=N, "
                    "layer_gil_ms=N, step_delay_ms=N, text_<stage>_after=N, "
                    "<message>_at_<point>=N)"
                )
            try:
                if name.startswith("text_") and name.endswith("_after"):
                    text_after[TextStage(name[len("text_") : -len("_after")])] = int(value)
                elif "_at_" in name:
                    message, _, point = name.rpartition("_at_")
                    what = None if message == OVERCOMMIT else DeviceMessage(message)
                    device.append(DeviceFault(what, SyncPoint(point), int(value)))
                elif name.endswith("_ms"):
                    layer_s[LayerStall(name[: -len("_ms")])] = int(value) / 1000.0
                else:
                    after[Fault(name[: -len("_after")])] = int(value)
            except ValueError:
                raise ValueError(
                    f"debug_faults: unknown fault {name!r} (device messages: "
                    f"{', '.join(m.value for m in DeviceMessage)}; sync points: "
                    f"{', '.join(p.value for p in SyncPoint)})"
                ) from None
        return cls(after, layer_s, tuple(device), text_after=text_after)

    def __bool__(self) -> bool:
        return bool(self.after) or bool(self.layer_s) or bool(self.device) or bool(self.text_after)

    @property
    def overcommits(self) -> bool:
        """An `overcommit` fault is set: a real allocation over the device's memory."""
        return any(fault.message is None for fault in self.device)

    def allocate_with(self, overcommit: Callable[[], None]) -> None:
        """How an `overcommit` fault allocates (the engine's: it needs MLX and a GPU)."""
        self._state.overcommit = overcommit

    def at(self, point: SyncPoint) -> None:
        """Called at a sync point on the engine thread: raise the armed device fault of `point`
        (once), as MLX raises a device failure there; an `overcommit` allocates more than the
        device holds, and MLX's own allocator raises."""
        state = self._state
        for fault in self.device:
            if fault.point is point and state.tokens >= fault.after and fault not in state.fired:
                state.fired.add(fault)
                what = fault.message.value if fault.message is not None else OVERCOMMIT
                log.warning("debug fault %s at %s after %d tokens", what, point.value, fault.after)
                if fault.message is not None:
                    raise RuntimeError(DEVICE_MESSAGES[fault.message])
                if state.overcommit is None:
                    raise RuntimeError("debug fault overcommit: no allocator was given")
                state.overcommit()

    def hostile_stages(self, prompt: str) -> frozenset[TextStage]:
        """The text stages whose fault a request with this prompt meets."""
        if HOSTILE_MARKER not in prompt:
            return frozenset()
        return frozenset(s for s in self.text_after if f"{HOSTILE_MARKER}:{s.value}" in prompt)

    def in_text(self, stage: TextStage, tokens_so_far: int) -> None:
        """Called in a text stage of a hostile request (hostile_stages): raises there once the
        request has produced the fault's N tokens."""
        n = self.text_after.get(stage)
        if n is not None and tokens_so_far >= n:
            log.warning("debug fault text_%s after %d tokens", stage.value, n)
            raise RuntimeError(f"debug fault: the {stage.value} stage failed")

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
        if self.device:
            self.at(SyncPoint.CHUNK)

    def before_step(self, tokens_so_far: int) -> None:
        """Called on the engine thread before each decoding step."""
        self._state.tokens = tokens_so_far
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
