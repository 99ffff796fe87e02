"""Reading ahead for the step that reads a prompt's last token.

That step (mlx-lm's split: a prompt's last token is read by a decode step, which samples the
first new token) sits on the way to the first token, and under streaming it reads its missing
experts layer by layer, each layer's once its router is known. In chat and agent use every
prompt ends with the same template text (`<|im_start|>assistant\n`, a tool result's closing
tags), so that one position routes much as it did at the previous prompt's end (measured on the
bench checkpoint: 15 of 16 experts the same, turn after turn; BENCHMARKS.md). So each layer's
experts at the last prompt's end are kept here, and read ahead as speculative reads: during a
prompt chunk, into a layer's pool as soon as the chunk is past that layer (and into the last
layer's at the chunk's start where the chunk skips it, unused_output.py), so the reads land
while the chunk computes; and, for those not resident by then, as the prompt-end step starts.
Only where reads wait on the SSD (the page cache bypassed, streamer.py): page-cache copies
are quick, and beside the chunk they take a core from it. Exact either way: only what is
resident changes. A wrong guess costs at most a step's experts
per layer, cancelled before they start where they can be; and where prompts end unlike each
other (recent prompt ends share under MIN_SHARED of their experts with the one before), nothing
is read ahead.
"""

from __future__ import annotations

import numpy as np

from moed.daemon.experts.engine_scope import EngineScope
from moed.daemon.experts.tuning import RecentShare

MIN_SHARED = 0.3  # below this share of a prompt end's experts also used by the one before: off
RECENT = 64  # layer records (a prompt end's layers, latest prompt ends) the share covers


class PromptEnd(EngineScope):
    """The experts of the last prompt-end step per layer, and whether one runs now (the engine
    enters `scope()` around it, on its thread)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.experts: list[np.ndarray | None] = [None] * layers
        self.ahead: list[frozenset[int]] = [frozenset()] * layers  # read ahead, per layer
        # Per layer record: experts the prompt end before used too, of those used.
        self._shared = RecentShare(RECENT)

    @property
    def shared(self) -> float | None:
        """The share of recent prompt ends' experts that the prompt end before used too."""
        return self._shared.value

    @property
    def worthwhile(self) -> bool:
        shared = self.shared
        return shared is None or shared >= MIN_SHARED

    def read(self, layer: int, experts: list[int]) -> None:
        """`experts` were read ahead into `layer` for the next prompt-end step."""
        self.ahead[layer] = self.ahead[layer].union(experts)

    def record(self, layer: int, host: np.ndarray | list[int]) -> int:
        """The router's choices of `layer` in the running prompt-end step (its rows' union);
        returns how many of them were read ahead."""
        before, now = self.experts[layer], np.unique(host)
        self.experts[layer] = now
        used = now.tolist()
        if before is not None:
            last = set(before.tolist())
            self._shared.add(sum(1 for e in used if e in last), len(used))
        ahead, self.ahead[layer] = self.ahead[layer], frozenset()
        return sum(1 for e in used if e in ahead)
