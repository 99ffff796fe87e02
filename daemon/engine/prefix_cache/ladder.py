"""Recurrent-state checkpoints while a row decodes (hybrid models): a ladder behind its newest
token that thins out with the distance.

The next turn sends the answer back, rendered by its client and the chat template, and that may
part from the generated tokens: a word tokenized another way, whitespace a client trimmed, a tool
call's arguments written out again. Attention layers resume at any common prefix; the
linear-attention state only where it was kept. So a decoding row keeps its state at the rungs of
a ladder behind its newest position: every position within 2 of it, every 2nd within 4, every
4th within 8, ... (counted from where the generation started), at most `max_checkpoints` of them
and `max_bytes` in all (the farthest go first). A position that leaves the ladder never comes
back, so the row drops states and never needs one it dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeLadder:
    max_checkpoints: int
    max_bytes: int  # one row's rungs in all

    @staticmethod
    def keeps(pos: int, now: int, start: int) -> bool:
        """Whether the state at `pos` stays a rung while the row holds `now` tokens (its
        generation started at `start`): spacing doubles as the distance doubles."""
        far = now - pos
        if far < 2:
            return True
        step = 1 << ((far // 2).bit_length() - 1)
        return (pos - start) % step == 0

    def drop(self, positions: Iterable[int], now: int, start: int, state_bytes: int) -> list[int]:
        """Which of a row's rungs (`positions`, each `state_bytes`) to let go at `now`."""
        held = sorted(positions)
        kept = [p for p in held if self.keeps(p, now, start)]
        limit = min(self.max_checkpoints, self.max_bytes // max(1, state_bytes))
        over = kept[: max(0, len(kept) - limit)]  # the farthest first
        return [p for p in held if p not in kept] + over
