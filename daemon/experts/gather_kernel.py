"""Which kernel MLX picks for a gathered quantized product, and the shape a pass must have so
that it picks the kernel mlx-lm's whole call picks.

A row's bits depend on the kernel that computes it (a vector kernel and a matrix kernel add in
different orders), and MLX picks the kernel by the call's shape. mlx-lm computes a layer's rows
in one call over every expert; a pass (streaming_switch.py) computes some of them on a pool of
fewer slots. Read from MLX's source, the same from 0.32.0 to 0.32.2 (`GatherQMM::eval_gpu`):

- CUDA (mlx/backend/cuda/quantized/quantized.cpp): `M * B < 8` takes `gather_qmv`, anything
  larger a matrix kernel (qmm_sm80, or qmm_naive). So a pass of fewer than 8 rows, where the
  whole call had more, took the vector kernel: the prompt's tokens at a 10% budget on an H100
  differed from resident's (BENCHMARKS.md, the 40-layer replica), 25% did not.
- Metal (mlx/backend/metal/quantized.cpp): `M == 1 && B >= 16 && right_sorted && B / E >= 4`
  takes `gather_qmm_rhs`, with E the experts in the weight array (a pool's slots, not the
  model's); a single row per batch entry otherwise takes `gather_qmv`.
- CPU: every row alone, whatever the call.

Rows here are the call's batch entries (B; M is 1: each (token, expert) row is its own matrix).
A matrix kernel's row is taken to be its own product whatever rows sit beside it (at 25% the
H200's passes of every size >= 8 were bit-identical, BENCHMARKS.md "Exactness of the streamed
paths on CUDA"), so a pass pads to the smallest shape that picks the whole call's kernel.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import mlx.core as mx

CUDA_MATRIX_ROWS = 8  # M * B at or above it: a matrix kernel
METAL_RHS_ROWS = 16  # the rows gather_qmm_rhs needs at least
METAL_RHS_ROWS_PER_EXPERT = 4  # and B / E at least this (integer division)


class Backend(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"
    METAL = "metal"


class GatherKernel(str, enum.Enum):
    ROW_BY_ROW = "row_by_row"  # the CPU's: the shape never matters
    VECTOR = "vector"  # gather_qmv
    MATRIX = "matrix"  # CUDA's qmm kernels
    MATRIX_RHS = "matrix_rhs"  # Metal's gather_qmm_rhs (sorted rows)


def backend_now() -> Backend:
    """The backend MLX computes on by default in this process."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return Backend.CPU
    return Backend.METAL if mx.metal.is_available() else Backend.CUDA


def kernel(backend: Backend, rows: int, experts: int, sorted_rows: bool) -> GatherKernel:
    """The kernel MLX picks for a gather_qmm of `rows` single-row entries over a weight array of
    `experts` experts."""
    if backend is Backend.CPU:
        return GatherKernel.ROW_BY_ROW
    if backend is Backend.CUDA:
        return GatherKernel.MATRIX if rows >= CUDA_MATRIX_ROWS else GatherKernel.VECTOR
    rhs = (
        sorted_rows
        and rows >= METAL_RHS_ROWS
        and rows // max(experts, 1) >= METAL_RHS_ROWS_PER_EXPERT
    )
    return GatherKernel.MATRIX_RHS if rhs else GatherKernel.VECTOR


@dataclass(frozen=True)
class PassShape:
    """How to call a pass: `rows` entries (its own first, then copies of its last row whose
    outputs are dropped) and whether to say they are sorted."""

    rows: int
    sorted_rows: bool

    def padding(self, own_rows: int) -> int:
        return self.rows - own_rows


@dataclass(frozen=True)
class KernelMatch:
    """The backend's rule, built once per streaming layer, and the model's experts per layer."""

    backend: Backend
    model_experts: int

    def pass_shape(
        self, whole_rows: int, whole_sorted: bool, own_rows: int, pool_experts: int
    ) -> PassShape:
        """The shape for a pass of `own_rows` of a call whose mlx-lm twin computes `whole_rows`
        (sorted or not) over all the model's experts, on a pool of `pool_experts` slots."""
        want = kernel(self.backend, whole_rows, self.model_experts, whole_sorted)
        if want is GatherKernel.MATRIX:  # CUDA: at least the matrix kernel's rows
            shape = PassShape(max(own_rows, CUDA_MATRIX_ROWS), whole_sorted)
        elif want is GatherKernel.MATRIX_RHS:  # Metal: enough sorted rows for the pool's slots
            least = max(METAL_RHS_ROWS, METAL_RHS_ROWS_PER_EXPERT * pool_experts)
            shape = PassShape(max(own_rows, least), True)
        elif want is GatherKernel.VECTOR and self.backend is Backend.METAL:
            shape = PassShape(own_rows, False)  # unsorted rows never take gather_qmm_rhs
        else:  # the CPU, or CUDA's vector kernel (a pass has no more rows than its call)
            shape = PassShape(own_rows, whole_sorted)
        got = kernel(self.backend, shape.rows, pool_experts, shape.sorted_rows)
        assert got is want, (self, whole_rows, own_rows, pool_experts, got, want)
        return shape
