"""K-reduction (`--max-active-experts K`): each token uses its K best experts instead of the
model's top-k. Lossy and opt-in, never the default.

The model's own routing code does it: every MoE block (and gate) of mlx-lm keeps its top-k in an
attribute (`top_k`, or `num_experts_per_tok` in mixtral and gpt_oss) that its `__call__` reads, so
setting it to K picks the K highest gates and renormalizes them exactly as the model's top-k does
(`norm_topk_prob`, deepseek's group-limited routing, gpt_oss's softmax over the chosen).
The streaming layers see K indices per token and read correspondingly fewer experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

TOP_K_ATTRS = ("top_k", "num_experts_per_tok")


class ActiveExpertsError(ValueError):
    """K is not a reduction this model can make."""


@dataclass(frozen=True)
class Routing:
    native: int  # the checkpoint's experts per token
    active: int  # what each token uses now

    @property
    def lossy(self) -> bool:
        return self.active < self.native

    def describe(self) -> dict[str, int | bool]:
        return {"active_experts": self.active, "native_experts": self.native, "lossy": self.lossy}


def _routing_attrs(model: nn.Module, native: int) -> list[tuple[nn.Module, str]]:
    """Every (module, attribute) holding the model's top-k: the MoE blocks and their gates."""
    found = []
    for _name, module in model.named_modules():
        for attr in TOP_K_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value == native:
                found.append((module, attr))
    return found


def limit_active_experts(model: nn.Module, native: int, k: int) -> Routing:
    """Make every token of `model` use its `k` best experts (`k` = 0 or `native`: unchanged)."""
    if k in (0, native):
        return Routing(native, native)
    if not 1 <= k < native:
        raise ActiveExpertsError(
            f"max_active_experts {k} is not allowed for this model: between 1 and its top-k "
            f"({native}), or 0 for the model's own routing"
        )
    attrs = _routing_attrs(model, native)
    if not attrs:
        raise ActiveExpertsError(
            f"this model keeps its top-k ({native}) in no attribute moed knows "
            f"({', '.join(TOP_K_ATTRS)}): it cannot serve fewer experts per token"
        )
    for module, attr in attrs:
        setattr(module, attr, k)
    return Routing(native, k)
