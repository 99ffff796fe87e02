"""A pass takes the gather kernel mlx-lm's whole call takes: the backends' rules as read from
MLX's source (daemon/experts/gather_kernel.py), the shapes that keep them, and, on this CPU
(where every row is its own product), the padded and re-flagged passes give resident's tokens."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_model

from moed.daemon.experts import gather_kernel, streaming_switch
from moed.daemon.experts.gather_kernel import Backend, GatherKernel, KernelMatch, kernel
from tests.fixtures.reference import SAMPLER, decode, streaming

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]
CHUNKS = (48, 2048)


def test_the_rules_read_from_mlx():
    assert kernel(Backend.CPU, 1, 256, False) is GatherKernel.ROW_BY_ROW
    # CUDA: M * B < 8 is gather_qmv, whatever the sort and the experts.
    assert kernel(Backend.CUDA, 7, 256, True) is GatherKernel.VECTOR
    assert kernel(Backend.CUDA, 8, 4, False) is GatherKernel.MATRIX
    # Metal: sorted, at least 16 rows and 4 rows per expert of the weight array.
    assert kernel(Backend.METAL, 1024, 256, True) is GatherKernel.MATRIX_RHS
    assert kernel(Backend.METAL, 1023, 256, True) is GatherKernel.VECTOR
    assert kernel(Backend.METAL, 1024, 256, False) is GatherKernel.VECTOR
    assert kernel(Backend.METAL, 100, 25, True) is GatherKernel.MATRIX_RHS
    assert kernel(Backend.METAL, 15, 2, True) is GatherKernel.VECTOR


@pytest.mark.parametrize("backend", list(Backend))
def test_every_pass_shape_takes_the_whole_calls_kernel(backend):
    model_experts = 256
    for whole in (1, 7, 8, 9, 64, 200, 1000, 1024, 2048, 4096):
        for whole_sorted in (False, True):
            want = kernel(backend, whole, model_experts, whole_sorted)
            for slots in (1, 2, 25, 64, 128, 256):
                for own in {1, 3, 7, 8, 15, 16, 99, 100, whole // 3 or 1, whole}:
                    if own > whole:
                        continue
                    shape = KernelMatch(backend, model_experts).pass_shape(
                        whole, whole_sorted, own, slots
                    )
                    assert shape.rows >= own and shape.padding(own) == shape.rows - own
                    assert kernel(backend, shape.rows, slots, shape.sorted_rows) is want
                    if backend is Backend.CPU:  # nothing changes where rows stand alone
                        assert (shape.rows, shape.sorted_rows) == (own, whole_sorted)


def test_cudas_small_pass_pads_to_the_matrix_kernel():
    shape = KernelMatch(Backend.CUDA, 256).pass_shape(2048, True, 3, 25)
    assert (shape.rows, shape.sorted_rows) == (8, True)
    # A call too small for the matrix kernel is vector in every pass: nothing added.
    assert KernelMatch(Backend.CUDA, 256).pass_shape(6, False, 2, 1).rows == 2


def test_metals_passes_follow_the_whole_calls_kernel():
    match = KernelMatch(Backend.METAL, 256)
    # mlx-lm's chunk of 128 tokens x top-8 takes gather_qmm_rhs: each pass too, padded.
    shape = match.pass_shape(1024, True, 40, 25)
    assert (shape.rows, shape.sorted_rows) == (100, True)
    # A smaller chunk is gather_qmv in mlx-lm: a pass of many rows on few slots must not sort.
    shape = match.pass_shape(512, True, 300, 25)
    assert (shape.rows, shape.sorted_rows) == (300, False)


@pytest.mark.parametrize("backend", [Backend.CUDA, Backend.METAL])
def test_padded_and_unsorted_passes_give_residents_tokens(backend, checkpoint_factory, monkeypatch):
    """The GPU's shapes forced on this CPU: the padding and the dropped sort flag are exercised
    for real, and the tokens (greedy and sampled) are resident's at budgets that need passes."""
    # 64 experts, top-2. Chunks of 48 tokens (96 rows): mlx-lm sorts them, and Metal still takes
    # gather_qmv (96 // 64 < 4), which a pass on a few slots must keep by not sorting; the whole
    # prompt as one chunk (298 rows) takes gather_qmm_rhs, which a pass keeps by padding.
    path = checkpoint_factory("qwen3_moe", bits=4, num_experts=64)

    def run(model):
        return [
            decode(model, PROMPT, 8, sampler, prefill_step_size=chunk)
            for chunk in CHUNKS
            for sampler in (None, SAMPLER)
        ]

    resident, _ = load_model(path)
    want = run(resident)
    del resident
    shapes = []
    real = KernelMatch.pass_shape

    def recorded(self, whole, whole_sorted, own, slots):
        shape = real(self, whole, whole_sorted, own, slots)
        shapes.append((whole_sorted, own, shape))
        return shape

    monkeypatch.setattr(streaming_switch, "backend_now", lambda: backend)
    monkeypatch.setattr(KernelMatch, "pass_shape", recorded)
    for budget in (1, "25%"):
        model, streamer = streaming(path, budget)
        try:
            got = run(model)
        finally:
            streamer.close()
        assert got == want, (backend, budget)
    assert any(shape.padding(own) > 0 for _, own, shape in shapes)
    if backend is Backend.METAL:  # sorted chunks too small for gather_qmm_rhs went unsorted
        assert any(was and not shape.sorted_rows for was, _, shape in shapes)
    assert gather_kernel.backend_now() is Backend.CPU  # the real one, here
