"""The streaming twin of mlx-lm's SwitchGLU / SwitchMLP.

It computes the same function with the same MLX calls (same sort rule, gather_mm / gather_qmm
with the same dtypes, group size, bits and mode, same bias handling), only on the layer's slot
pools with expert ids remapped to slots. When a call needs more distinct experts than the layer
has slots (a batch's union, or a prompt chunk), it runs several passes: each (token, expert) row
is computed once, in the pass that holds its expert (a prompt chunk's rows ordered by expert
within the pass, as mlx-lm orders them), and the rows are put back in order by a permutation.
Results stay bit-identical on the CPU backend (tests/experts); see multi_pass.py for the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwiGLU

from moed.daemon.experts.gather_kernel import Backend, KernelMatch, backend_now
from moed.daemon.experts.multi_pass import MultiPass

if TYPE_CHECKING:  # types only: the cache is reached through LayerCache (streamer imports us)
    from moed.daemon.experts.cache import LayerPool
    from moed.daemon.experts.counters import Counters
    from moed.daemon.experts.loads import DecodeGraph, PendingLoad
    from moed.daemon.experts.passes import LoadedPass
    from moed.daemon.experts.tuning import Switch


def gather_sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Rows of `x` ordered by expert, as mlx-lm's `switch_layers._gather_sort` orders them (a
    copy of its lines: private names of mlx-lm are no API; tests/experts/test_switch_sort.py
    compares)."""
    *_, M = indices.shape
    indices = indices.flatten()
    order = mx.argsort(indices)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // M], indices[order], inv_order


def scatter_unsort(
    x: mx.array, inv_order: mx.array, shape: Sequence[int] | None = None
) -> mx.array:
    """Undo `gather_sort` (a copy of mlx-lm's `switch_layers._scatter_unsort`)."""
    x = x[inv_order]
    if shape is not None:
        x = mx.unflatten(x, 0, shape)
    return x


def distinct(host: np.ndarray) -> np.ndarray:
    """The call's distinct experts, ascending (np.unique; a set for a decode step's few ids,
    several times cheaper on the hot path)."""
    flat = host.reshape(-1)
    if flat.size <= 64:
        return np.array(sorted(set(flat.tolist())), dtype=flat.dtype)
    return np.unique(flat)


class LayerCache(Protocol):
    """What a streaming layer asks of the expert cache (experts/streamer.py ExpertStreamer)."""

    counters: Counters
    overlap: Switch  # whether to compute resident rows during the reads
    launch_early: bool  # submit a host-routed call's output to the device once built

    def output_unused(self) -> bool: ...

    def begin_call(self, layer: int, indices: mx.array) -> None: ...

    def on_device(self, layer: int) -> bool: ...

    def route_on_device(self, layer: int, indices: mx.array) -> mx.array | None: ...

    def pools_of(self, layer: int) -> dict[str, mx.array]: ...

    def route(self, layer: int, indices: mx.array, x: mx.array | None = None) -> np.ndarray: ...

    def decode_call(
        self, layer: int, indices: mx.array, x: mx.array, graph: DecodeGraph
    ) -> tuple[mx.array | None, list[int]]: ...

    def plan_passes(self, layer: int, needed: np.ndarray) -> list[np.ndarray]: ...

    def load(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, dict[str, mx.array]]: ...

    def load_passes(self, layer: int, passes: list[np.ndarray]) -> Iterator[LoadedPass]: ...

    def submit_pass(
        self, layer: int, done: LoadedPass, out: mx.array, slots_read: list[int]
    ) -> None: ...

    def begin_load(self, layer: int, experts: np.ndarray) -> PendingLoad: ...

    def finish_load(self, p: PendingLoad) -> None: ...

    def defer(self, layer: int, out: mx.array, slots_read: Iterable[int]) -> None: ...


@dataclass(frozen=True)
class ProjSpec:
    name: str  # gate_proj, up_proj, down_proj, fc1, fc2
    quantized: bool
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"
    has_bias: bool = False  # additive bias (gpt_oss)


def _as_is(fn: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """No compilation: activations other than mlx-lm's SwiGLU run op by op, as mlx-lm runs them."""
    return fn


_PARAMS = ("weight", "scales", "biases", "global_scale", "bias")  # a projection's pool tensors


class StreamingSwitch(nn.Module):
    # Set with object.__setattr__ in __init__ (not module children): declared for the checker.
    _projs: dict[str, ProjSpec]
    _keys: dict[str, tuple[str, ...]]
    _layer: int
    _streamer: LayerCache
    _final: bool
    _compile: Callable[..., Callable[..., mx.array]]
    _decode_graph: Callable[[mx.array, mx.array, mx.array, dict[str, mx.array]], mx.array]
    _multi_pass: MultiPass

    def __init__(
        self,
        kind: str,
        projs: dict[str, ProjSpec],
        activation: Callable[..., mx.array],
        layer: int,
        streamer: LayerCache,
        final: bool = False,
        num_experts: int = 0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx: Module.__init__ unannotated
        self.kind = kind  # "glu" or "mlp"
        self.activation = activation
        # Plain attributes (not parameters): the pools live in the streamer, never in the model
        # tree.
        object.__setattr__(self, "_projs", projs)
        # The pool keys of each projection, formatted once (the hot path only looks them up).
        keys = {n: tuple(f"{n}.{p}" for p in _PARAMS) for n in projs}
        object.__setattr__(self, "_keys", keys)
        object.__setattr__(self, "_layer", layer)
        object.__setattr__(self, "_streamer", streamer)
        # In the model's last decoder layer: a dropped prompt chunk skips it (unused_output.py).
        object.__setattr__(self, "_final", final)
        # The decode call's graph (expand, three projections, activation, squeeze) as one
        # compiled call where the activation is mlx-lm's SwiGLU, itself compiled: the same fused
        # kernel either way, and one call builds the graph instead of seven, each with its own
        # host cost. Other activations run op by op, as mlx-lm runs them.
        fused = kind == "glu" and type(activation) is SwiGLU
        compile_: Callable[..., Callable[..., mx.array]] = mx.compile if fused else _as_is
        object.__setattr__(self, "_compile", compile_)
        object.__setattr__(self, "_decode_graph", compile_(self._decode_rows))
        # A pass's shape picks the gather kernel mlx-lm's whole call picks (gather_kernel.py);
        # the rule is gather_qmm's: gather_mm picks by the sort flag alone, which passes keep.
        quantized = any(spec.quantized for spec in projs.values())
        backend = backend_now() if quantized else Backend.CPU
        kernels = KernelMatch(backend, num_experts)
        first_weight = keys["up_proj" if kind == "glu" else "fc1"][0]
        # The calls that are not decode steps (prompt chunks, several passes): multi_pass.py.
        passes = MultiPass(self._experts, first_weight, layer, streamer, kernels)
        object.__setattr__(self, "_multi_pass", passes)

    def _proj(
        self,
        name: str,
        x: mx.array,
        idx: mx.array,
        sorted_indices: bool,
        pools: dict[str, mx.array],
    ) -> mx.array:
        spec = self._projs[name]
        weight, scales, biases, global_scale, bias = self._keys[name]
        if spec.quantized:
            y = mx.gather_qmm(
                x,
                pools[weight],
                pools[scales],
                pools.get(biases),
                rhs_indices=idx,
                transpose=True,
                group_size=spec.group_size,
                bits=spec.bits,
                mode=spec.mode,
                global_scale=pools.get(global_scale),
                sorted_indices=sorted_indices,
            )
        else:
            y = mx.gather_mm(
                x,
                pools[weight].swapaxes(-1, -2),
                rhs_indices=idx,
                sorted_indices=sorted_indices,
            )
        if spec.has_bias:
            y = y + mx.expand_dims(pools[bias][idx], -2)
        return y

    def _experts(
        self, x: mx.array, idx: mx.array, do_sort: bool, pools: dict[str, mx.array]
    ) -> mx.array:
        if self.kind == "glu":
            x_up = self._proj("up_proj", x, idx, do_sort, pools)
            x_gate = self._proj("gate_proj", x, idx, do_sort, pools)
            return self._proj("down_proj", self.activation(x_up, x_gate), idx, do_sort, pools)
        x = self._proj("fc1", x, idx, do_sort, pools)
        return self._proj("fc2", self.activation(x), idx, do_sort, pools)

    def _decode_rows(
        self, x: mx.array, indices: mx.array, table: mx.array, pools: dict[str, mx.array]
    ) -> mx.array:
        """A one-pass call's output from the layer's input, the router's indices and the pool's
        expert -> slot table (unsorted rows; the slot ids are looked up on the device)."""
        idx = mx.take(table, indices)
        return self._experts(mx.expand_dims(x, (-2, -3)), idx, False, pools).squeeze(-2)

    def _decode(self, x: mx.array, indices: mx.array, pool: LayerPool) -> mx.array:
        """The decode graph on `pool` (host_route.py DecodeGraph). A DIRECT pool's arrays and
        table are built into it as constants, kept with the pool until it makes new ones: a
        compiled call with two inputs instead of twelve costs less host time (they are the same
        objects, written in place by reads and admissions, so the graph reads their bytes as of
        its evaluation). A staged pool's landing makes new arrays: they go in as inputs."""
        if pool.staged:
            return self._decode_graph(x, indices, pool.device_table(), pool.arrays)
        graph = pool.decode_graph
        if graph is None:
            rows, table, arrays = self._decode_rows, pool.device_table(), pool.arrays
            graph = pool.decode_graph = self._compile(lambda x, i: rows(x, i, table, arrays))
        return graph(x, indices)

    def expert_rows(self, x: mx.array, idx: mx.array, pools: dict[str, mx.array]) -> mx.array:
        """The expert function on given pools, unsorted (row_split.py probes the device)."""
        return self._experts(x, idx, False, pools)

    def input_dims(self, pools: dict[str, mx.array]) -> int:
        """The hidden size the first projection reads, from its pool's weight."""
        name = "up_proj" if self.kind == "glu" else "fc1"
        spec, weight = self._projs[name], pools[self._keys[name][0]]
        return weight.shape[-1] * 32 // spec.bits if spec.quantized else weight.shape[-1]

    def _one_pass(self, x: mx.array, host: np.ndarray, pending: PendingLoad) -> mx.array:
        """All of the call's experts fit one pass: wait for its reads, then one graph whose slot
        ids are mapped on the host (no expert -> slot table, no gather on the device)."""
        streamer = self._streamer
        streamer.finish_load(pending)
        slot_of = pending.pool.slot_of
        y = self._experts(x, mx.array(slot_of[host].astype(np.uint32)), False, pending.pool.arrays)
        streamer.defer(self._layer, y, slot_of[pending.experts].tolist())
        return y

    def _overlapped(
        self, x: mx.array, indices: mx.array, host: np.ndarray, experts: np.ndarray
    ) -> mx.array:
        """Rows whose expert is resident are computed while the missing experts are read, then
        the rest; each (token, expert) row is the same matrix-vector product either way, and the
        two groups are put back in order by a permutation (no arithmetic)."""
        streamer, layer = self._streamer, self._layer
        pending = streamer.begin_load(layer, experts)
        ready = pending.ready
        ids = host.ravel().tolist()  # lists: a call's few rows cost less than numpy calls
        first = [i for i, e in enumerate(ids) if e in ready]
        if not first or len(first) == len(ids):
            return self._one_pass(x, host, pending)
        rest = [i for i, e in enumerate(ids) if e not in ready]
        pools, slot_of = pending.pool.arrays, pending.pool.slot_of
        rows = mx.broadcast_to(x, (*indices.shape, 1, x.shape[-1])).reshape(-1, 1, x.shape[-1])
        slots = slot_of[host.ravel()].tolist()  # the ready experts' slots are final
        y_first = self._experts(
            rows[mx.array(first)],
            mx.array([slots[i] for i in first], dtype=mx.uint32),
            False,
            pools,
        )
        mx.async_eval(y_first)  # runs while the reads land; not a host sync
        streamer.counters.overlapped += 1
        streamer.finish_load(pending)
        slots = slot_of[host.ravel()].tolist()
        y_rest = self._experts(
            rows[mx.array(rest)], mx.array([slots[i] for i in rest], dtype=mx.uint32), False, pools
        )
        perm = first + rest
        order = mx.array(sorted(range(len(perm)), key=perm.__getitem__))  # argsort of perm
        y = mx.concatenate([y_first, y_rest])[order]
        y = y.reshape(*indices.shape, *y.shape[-2:])
        streamer.defer(layer, y, slots)
        return y

    def _on_device(self, x: mx.array, indices: mx.array, dep: mx.array | None) -> mx.array:
        """Every expert is held and slot e holds expert e (held.py): mlx-lm's own SwitchGLU call
        on the pool, with the router's indices as they are on the device."""
        pools = self._streamer.pools_of(self._layer)
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= 64
        idx, inv_order = indices, None
        if do_sort:
            x, idx, inv_order = gather_sort(x, indices)
        out = self._experts(x, idx, do_sort, pools)
        if inv_order is not None:  # the rows were sorted (do_sort)
            out = scatter_unsort(out, inv_order, indices.shape)
        out = out.squeeze(-2)
        if dep is not None:  # the step's usage tally is computed with the step, not apart
            (out,) = mx.depends([out], [dep])
        return out

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        t0 = time.perf_counter()
        streamer, layer = self._streamer, self._layer
        # A prompt chunk (several positions) whose output nobody reads: route and read nothing.
        if self._final and indices.ndim >= 3 and indices.shape[-2] > 1 and streamer.output_unused():
            return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)
        streamer.begin_call(layer, indices)
        if streamer.on_device(layer):
            out = self._on_device(x, indices, streamer.route_on_device(layer, indices))
            streamer.counters.layer_s += time.perf_counter() - t0
            return out
        do_sort = indices.size >= 64
        if do_sort:
            host = streamer.route(layer, indices, x)
        else:  # the decode call: one graph, built before the read-back
            # Not evaluated here: the streamer fences it before any slot it reads is reused.
            done, ids = streamer.decode_call(layer, indices, x, self._decode)
            if done is not None:
                return self._routed_out(done, t0)
            host = np.array(ids, dtype=np.intp).reshape(indices.shape)
        x = mx.expand_dims(x, (-2, -3))
        needed = distinct(host)
        passes = streamer.plan_passes(layer, needed)

        inv_order: mx.array | None = None
        if len(passes) > 1:  # more distinct experts than slots: each pass its own rows
            out = self._multi_pass.rows_by_pass(x, indices, host, passes, do_sort)
        elif do_sort:
            x, idx, inv_order = gather_sort(x, mx.stop_gradient(indices))
            out = self._multi_pass.sorted_one_pass(x, idx, needed, passes[0])
        elif streamer.overlap.active:
            out = self._overlapped(x, indices, host, passes[0])
        else:  # speculative reads in flight for the layer
            out = self._one_pass(x, host, streamer.begin_load(layer, passes[0]))

        if inv_order is not None:  # the rows were sorted (do_sort)
            out = scatter_unsort(out, inv_order, indices.shape)
        return self._routed_out(out.squeeze(-2), t0)

    def _routed_out(self, out: mx.array, t0: float) -> mx.array:
        """A host-routed call's output, submitted to the device now where the streamer launches
        early (it then runs while the host builds the graph up to the next read-back)."""
        streamer = self._streamer
        if streamer.launch_early:
            mx.async_eval(out)
        streamer.counters.layer_s += time.perf_counter() - t0
        return out
