"""The streaming switch's own copies of mlx-lm's expert sort (`switch_layers._gather_sort` and
`_scatter_unsort`, private names the daemon must not import) give mlx-lm's exact results: the
token identity at prefill (64+ routings, the sorted path) depends on the same row order."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import switch_layers

from moed.daemon.experts.streaming_switch import gather_sort, scatter_unsort


@pytest.mark.parametrize("shape", [(1, 64, 2), (2, 40, 8), (3, 5, 4)])
def test_sort_copies_match_mlx_lm(shape):
    *lead, k = shape
    mx.random.seed(sum(shape))
    x = mx.random.normal((*lead, 1, 1, 16))  # as SwitchGLU expands its input
    indices = mx.random.randint(0, 32, shape).astype(mx.uint32)

    ours = gather_sort(x, indices)
    theirs = switch_layers._gather_sort(x, indices)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))

    y = ours[0] * 3.0  # any per-row result, back in token order
    np.testing.assert_array_equal(
        np.array(scatter_unsort(y, ours[2], indices.shape)),
        np.array(switch_layers._scatter_unsort(y, theirs[2], indices.shape)),
    )
    np.testing.assert_array_equal(
        np.array(scatter_unsort(y, ours[2])), np.array(switch_layers._scatter_unsort(y, theirs[2]))
    )
