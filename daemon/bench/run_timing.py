"""One timed generation (time to first token, decode speed, the tokens), as every bench that
times a path reports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunTiming:
    ttft_s: float
    decode_tps: float
    tokens: list[int]
    text: str = ""
    cpu_s: float = 0.0  # CPU time of the reading thread (the client library's share)


def decode_tps(stamps: list[float]) -> float:
    return (
        (len(stamps) - 1) / (stamps[-1] - stamps[0])
        if len(stamps) > 1 and stamps[-1] > stamps[0]
        else 0.0
    )
