"""Parse a cache budget and turn it into expert slots per layer.

A budget is bytes (`3000000`), a size (`512MB`, `12GB`, `1.5GiB`), a fraction of all experts'
bytes (`25%`, `0.25`), or `auto` (what the memory plan leaves free).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class BudgetError(ValueError):
    pass


class BudgetKind(enum.Enum):
    BYTES = "bytes"
    FRACTION = "fraction"  # of all routed experts' bytes
    AUTO = "auto"  # what the memory plan leaves free


@dataclass(frozen=True)
class CacheBudget:
    """A cache budget parsed once (at the configuration's edge); the memory plan resolves it to
    bytes. `text` is the budget as given, for logs and a follower's spec."""

    kind: BudgetKind
    amount: float = 0.0  # bytes, or the fraction
    text: str = "auto"

    @classmethod
    def parse(cls, spec: str | int | float) -> CacheBudget:
        if isinstance(spec, bool):
            raise BudgetError(f"invalid cache budget {spec!r}")
        if isinstance(spec, int):
            return cls(BudgetKind.BYTES, _positive(spec, spec), str(spec))
        if isinstance(spec, float):
            return cls(BudgetKind.FRACTION, _fraction(spec, spec), str(spec))
        text = str(spec).strip().lower()
        if text == "auto":
            return cls(BudgetKind.AUTO, 0.0, str(spec))
        if text.endswith("%"):
            try:
                frac = float(text[:-1]) / 100.0
            except ValueError:
                raise BudgetError(f"invalid cache budget {spec!r}") from None
            return cls(BudgetKind.FRACTION, _fraction(frac, spec), str(spec))
        m = _SIZE.match(text)
        if not m or m.group(2) not in _UNITS:
            raise BudgetError(
                f"invalid cache budget {spec!r} (use bytes, 12GB, 512MiB, 25%, 0.25 or auto)"
            )
        number, unit = float(m.group(1)), m.group(2)
        # A bare number below or at 1 is a fraction ("0.25"); anything else is bytes.
        if unit == "" and number <= 1.0 and "." in m.group(1):
            return cls(BudgetKind.FRACTION, _fraction(number, spec), str(spec))
        return cls(BudgetKind.BYTES, _positive(int(number * _UNITS[unit]), spec), str(spec))

    @classmethod
    def of_bytes(cls, n: int) -> CacheBudget:
        return cls(BudgetKind.BYTES, _positive(int(n), n), str(int(n)))

    def resolve(self, experts_bytes: int, auto_bytes: int | None = None) -> int:
        """Bytes. `experts_bytes` is the size of all routed experts (what 100% means)."""
        if self.kind is BudgetKind.BYTES:
            return int(self.amount)
        if self.kind is BudgetKind.FRACTION:
            return int(self.amount * experts_bytes)
        if auto_bytes is None:
            raise BudgetError("cache budget 'auto' needs a memory plan")
        return max(0, int(auto_bytes))

    def __str__(self) -> str:
        return self.text


def parse_budget(spec: str | int | float, experts_bytes: int, auto_bytes: int | None = None) -> int:
    """Budget in bytes. `experts_bytes` is the size of all routed experts (what 100% means)."""
    return CacheBudget.parse(spec).resolve(experts_bytes, auto_bytes)


def parse_size(spec: str | int) -> int:
    """A size in bytes (`3000000`, `12GB`, `512MiB`); 0 allowed (a tier that is off)."""
    m = _SIZE.match(str(spec).lower())
    if isinstance(spec, bool) or not m or m.group(2) not in _UNITS:
        raise BudgetError(f"invalid size {spec!r} (use bytes, 12GB or 512MiB; 0 for off)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _fraction(frac: float, spec: object) -> float:
    if not 0.0 < frac <= 1.0:
        raise BudgetError(f"cache budget fraction {spec!r} must be in (0, 1]")
    return frac


def _positive(n: int, spec: object) -> int:
    if n <= 0:
        raise BudgetError(f"cache budget {spec!r} must be positive")
    return n


def slots_per_layer(
    budget_bytes: int, layer_expert_bytes: list[int], num_experts: list[int]
) -> list[int]:
    """The same slot count for every layer: as many as the budget pays for, at least one and at
    most all of the layer's experts."""
    per_slot_all_layers = sum(layer_expert_bytes)
    n = budget_bytes // per_slot_all_layers if per_slot_all_layers else 0
    return [max(1, min(int(n), e)) for e in num_experts]
