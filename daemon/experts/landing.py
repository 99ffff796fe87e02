"""Where an expert read lands: in the slot's own bytes, or in host rows the device copies in.

DIRECT (the default off CUDA): a read writes the slot array's buffer in place, no copy (Metal's
unified memory, the CPU); a slot is only overwritten once no pending graph reads it (the
streamer's fence). STAGED (the default on CUDA): MLX keeps arrays the host can write in managed
memory, where a host write to a page the GPU last touched faults it back, so DIRECT reads reached
half of the disk's raw bandwidth on an H200. STAGED reads land in the rows of a small ring per
pool, allocated once and advised to stay in host memory, mapped for the GPU (staging.py,
cuda_memory.py), and one scatter per burst copies them into slot arrays the device owns; the
scatter makes a new version of the pool, so a graph still pending keeps reading the old one and no
fence is needed. A ring row is written again only once the scatter reading it ran. Measured on the
H200 (BENCHMARKS.md): reads 0.6x raw instead of 0.47x, and 1.12-1.17x the tokens per second of
DIRECT; the first STAGED, fresh numpy rows copied by `mx.array` each burst, had cost more than it
saved. AUTO, the configuration's default, picks one of the two by the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Landing(enum.Enum):
    AUTO = "auto"  # STAGED where MLX runs on CUDA (measured faster there), else DIRECT
    DIRECT = "direct"
    STAGED = "staged"

    def resolve(self, on_cuda: bool) -> Landing:
        if self is Landing.AUTO:
            return Landing.STAGED if on_cuda else Landing.DIRECT
        return self


@dataclass(eq=False)
class Staging:
    """One burst's loads [(expert, slot)] and, for a STAGED pool, the host rows they land in: rows
    `first`, `first + 1`, ... of the pool's staging ring (load i in row first + i), or, for a
    burst the ring cannot hold, `buffers` (row i of each tensor's buffer is load i)."""

    loads: list[tuple[int, int]]
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    first: int = -1  # the first ring row; -1: not in the ring
    landed: bool = False
