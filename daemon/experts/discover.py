"""Find a loaded mlx-lm model's SwitchGLU / SwitchMLP layers, their routers and their expert
tensors on disk (following the model's sanitize renames)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

from moed.daemon.experts.cache import PooledTensor, mlx_dtype
from moed.daemon.experts.memory_plan import _natural
from moed.daemon.experts.safetensors_index import CheckpointError, CheckpointIndex, TensorLoc
from moed.daemon.experts.streaming_switch import ProjSpec

log = logging.getLogger(__name__)

_PARAMS = ("weight", "scales", "biases", "bias", "global_scale")
_GLU_PROJS = ("gate_proj", "up_proj", "down_proj")
_MLP_PROJS = ("fc1", "fc2")


@dataclass(frozen=True)
class SwitchInfo:
    path: str  # module path, e.g. "model.layers.3.mlp.switch_mlp"
    kind: str
    module: nn.Module
    projs: dict[str, ProjSpec]
    tensors: list[PooledTensor]
    num_experts: int
    router: nn.Module | None = None  # the sibling gate that routes to this switch


def find_switches(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every SwitchGLU / SwitchMLP, in depth order (named_modules lists them last layer first)."""
    found = [
        (name, m) for name, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))
    ]
    return sorted(found, key=lambda nm: _natural(nm[0]))


def _proj_spec(name: str, lin: nn.Module) -> tuple[ProjSpec, dict[str, mx.array]]:
    arrays = {p: lin[p] for p in _PARAMS if p in lin and isinstance(lin[p], mx.array)}
    if isinstance(lin, QuantizedSwitchLinear):
        spec = ProjSpec(
            name,
            True,
            lin.group_size,
            lin.bits,
            lin.mode,
            has_bias="bias" in arrays,
        )
    elif isinstance(lin, SwitchLinear):
        spec = ProjSpec(name, False, has_bias="bias" in arrays)
    else:
        raise CheckpointError(f"unsupported expert projection {name}: {type(lin).__name__}")
    return spec, arrays


def _resolve(
    model: nn.Module, index: CheckpointIndex, wanted: dict[str, mx.array]
) -> dict[str, TensorLoc]:
    """Map model parameter paths to tensors on disk. Names usually match; when the model's
    sanitize renames keys (e.g. qwen3_5_moe's language_model prefix), follow the renaming by
    identity of the lazily loaded arrays; as a last resort match the `layers.N...` suffix."""
    found = {p: index[p] for p in wanted if p in index}
    missing = [p for p in wanted if p not in found]
    if missing and hasattr(model, "sanitize"):
        loaded: dict[str, mx.array] = {}
        for f in index.files:
            # lazy: nothing is read; a .safetensors file loads as a dict of arrays
            loaded.update(cast(dict[str, mx.array], mx.load(str(f))))
        by_id = {id(v): k for k, v in loaded.items()}
        try:
            sanitized = model.sanitize(dict(loaded))
        except Exception as exc:  # noqa: BLE001 - a failing sanitize only loses this strategy
            log.debug("sanitize probe failed: %s", exc)
            sanitized = {}
        for p in missing:
            v = sanitized.get(p)
            if v is not None and id(v) in by_id:
                found[p] = index[by_id[id(v)]]
        del loaded, sanitized, by_id
        missing = [p for p in wanted if p not in found]
    for p in missing:
        if "layers." not in p:
            continue
        tail = p[p.index("layers.") :]
        cands = [
            loc
            for n, loc in index.tensors.items()
            if (n == tail or n.endswith("." + tail)) and loc.shape == tuple(wanted[p].shape)
        ]
        if len(cands) == 1:
            found[p] = cands[0]
    for p, arr in wanted.items():
        loc = found.get(p)
        if loc is None:
            raise CheckpointError(
                f"expert tensor {p} is not stored as-is in {index.model_path} "
                "(a sanitize step transforms it); "
                "convert the checkpoint with mlx_lm.convert first"
            )
        if loc.shape != tuple(arr.shape) or mlx_dtype(loc.dtype) != arr.dtype:
            raise CheckpointError(
                f"expert tensor {p}: {loc.name} on disk is {loc.dtype}{list(loc.shape)}, "
                f"the model expects {arr.dtype}{list(arr.shape)}"
            )
    return found


def describe_switches(model: nn.Module, index: CheckpointIndex) -> list[SwitchInfo]:
    found = find_switches(model)
    if not found:
        raise CheckpointError("the model has no SwitchGLU / SwitchMLP layers: nothing to stream")
    specs, wanted = [], {}
    for path, m in found:
        kind = "glu" if isinstance(m, SwitchGLU) else "mlp"
        projs, arrays = {}, {}
        for name in _GLU_PROJS if kind == "glu" else _MLP_PROJS:
            spec, arrs = _proj_spec(name, m[name])
            projs[name] = spec
            for p, a in arrs.items():
                arrays[(name, p)] = a
                wanted[f"{path}.{name}.{p}"] = a
        specs.append((path, kind, m, projs, arrays))
    locs = _resolve(model, index, wanted)
    out = []
    for path, kind, m, projs, arrays in specs:
        tensors = [PooledTensor(name, p, locs[f"{path}.{name}.{p}"]) for (name, p) in arrays]
        num = {t.loc.shape[0] for t in tensors}
        if len(num) != 1:
            raise CheckpointError(
                f"{path}: expert tensors disagree on the number of experts {sorted(num)}"
            )
        n = num.pop()
        out.append(SwitchInfo(path, kind, m, projs, tensors, n, _find_router(model, path, m, n)))
    return out


def _find_router(
    model: nn.Module, path: str, switch: nn.Module, num_experts: int
) -> nn.Module | None:
    """The switch's sibling whose weight maps the hidden state to one logit per expert (`gate`,
    `router`, DeepSeek's MoEGate); None when there is no single such module."""
    parent: Any = model
    for part in path.split(".")[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    found = []
    for _name, child in parent.children().items():
        if child is switch or not isinstance(child, nn.Module):
            continue
        weight = child.get("weight") if hasattr(child, "get") else None
        if isinstance(weight, mx.array) and weight.ndim == 2 and weight.shape[0] == num_experts:
            found.append(child)
    return found[0] if len(found) == 1 else None


def set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parts = path.split(".")
    parent: Any = model
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    last = parts[-1]
    if isinstance(parent, list):
        parent[int(last)] = new
    else:
        setattr(parent, last, new)
