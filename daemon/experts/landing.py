"""Where an expert read lands: in the slot's own bytes, or in host rows the device copies in.

DIRECT (the default): a read writes the slot array's buffer in place, no copy (Metal's unified
memory, the CPU); a slot is only overwritten once no pending graph reads it (the streamer's fence).
STAGED (opt-in, for CUDA): MLX keeps arrays the host can write in managed memory, where a host
write to a page the GPU last touched faults it back, so DIRECT reads reached half of the disk's raw
bandwidth on an H200. STAGED reads land in plain host rows, and one scatter per burst puts them
into slot arrays the device owns; the scatter makes a new version of the pool, so a graph still
pending keeps reading the old one and no fence is needed. Measured on the H200 (BENCHMARKS.md):
reads 0.67x raw instead of 0.50x, but the engine thread's copy of the rows into managed memory cost
more than that saved, so it is not the default anywhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Landing(enum.Enum):
    DIRECT = "direct"
    STAGED = "staged"


@dataclass(eq=False)
class Staging:
    """One burst's loads [(expert, slot)] and, for a STAGED pool, the host rows they land in (row
    i of each tensor's buffer is load i)."""

    loads: list[tuple[int, int]]
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    landed: bool = False
