"""Eviction policies, chosen by name (`[serve] cache_policy`, `moed serve --cache-policy`).

The daemon's slot pools and `moed trace analyze` / `moed bench policy` build their policies from
this one registry, so a simulation replays exactly what the daemon runs. Pure Python: importing
it never loads MLX (the configuration validates names with it).
"""

from __future__ import annotations

from moed.daemon.experts.policies.base import AllProtectedError, EvictionPolicy
from moed.daemon.experts.policies.lfu import LFUDecayPolicy
from moed.daemon.experts.policies.lru import LRUPolicy
from moed.daemon.experts.policies.slru import SLRUPolicy

# The winner of `moed bench policy` on the demo model's held-out traces (BENCHMARKS.md).
DEFAULT_POLICY = "lfu"

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUDecayPolicy, SLRUPolicy)
}


class UnknownPolicyError(ValueError):
    def __init__(self, name: str):
        super().__init__(f"unknown cache policy {name!r} (allowed: {', '.join(policy_names())})")
        self.policy = name


def policy_names() -> list[str]:
    return list(POLICIES)


def policy_class(name: str) -> type[EvictionPolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(name) from None


def make_policy(name: str, num_experts: int, slots: int, **params: float) -> EvictionPolicy:
    """A fresh policy for one layer's cache of `slots` slots over `num_experts` experts; `params`
    override the policy's fitted defaults (`moed bench policy` fits them)."""
    return policy_class(name)(num_experts, slots, **params)


__all__ = [
    "AllProtectedError",
    "DEFAULT_POLICY",
    "EvictionPolicy",
    "LFUDecayPolicy",
    "LRUPolicy",
    "POLICIES",
    "SLRUPolicy",
    "UnknownPolicyError",
    "make_policy",
    "policy_class",
    "policy_names",
]
