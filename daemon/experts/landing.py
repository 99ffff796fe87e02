"""Where an expert read lands: in the slot's own bytes, or in host buffers the device copies in.

DIRECT (Metal's unified memory, the CPU): a read writes the slot array's buffer in place, no
copy; a slot is only overwritten once no pending graph reads it (the streamer's fence).
STAGED (CUDA): MLX keeps arrays the host can write in managed memory, where every host write to
a page the GPU last touched faults it back (reads reached half the disk's raw bandwidth on an
H200) and kernels run slower on host-written pages. So reads land in plain host buffers, and one
scatter per burst puts them into slot arrays the device owns. The scatter makes a new version of
the pool: a graph still pending keeps reading the old one, so no fence is needed either.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


class Landing(enum.Enum):
    AUTO = "auto"  # STAGED on a CUDA GPU, DIRECT elsewhere
    DIRECT = "direct"
    STAGED = "staged"


def resolve_landing(choice: Landing | str) -> Landing:
    choice = Landing(choice)
    if choice is not Landing.AUTO:
        return choice
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    return Landing.STAGED if on_gpu and not mx.metal.is_available() else Landing.DIRECT


@dataclass(eq=False)
class Staging:
    """One burst's loads [(expert, slot)] and, for a STAGED pool, the host rows they land in (row
    i of each tensor's buffer is load i)."""

    loads: list[tuple[int, int]]
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    landed: bool = False
