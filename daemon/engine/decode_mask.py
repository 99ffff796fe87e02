"""No attention mask for a decode step when no row of the batch is left-padded.

mlx-lm's BatchKVCache builds a causal mask with the rows' left padding at every step (a few ops,
then the attention's masked path in every layer): about 7% of a token on the demo model. With no
row padded (one request alone, or rows of equal length) a one-token step's mask is all true, the
same attention as none, which is what mlx-lm's own single-stream cache passes.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import BatchKVCache

from moed.daemon.model.layer_caches import LayerCache
from moed.daemon.model.mlx_compat import recast, unpadded


class UnpaddedBatchKVCache(BatchKVCache):
    """A BatchKVCache known to hold no left padding: a one-token step goes unmasked."""

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        # A window or a caller asking for an array still gets the real mask.
        if N == 1 and not return_array and kwargs.get("window_size") is None:
            return None
        return super().make_mask(N, return_array=return_array, **kwargs)


def fit_masks(layer_caches: list[LayerCache]) -> None:
    """Mark each plain BatchKVCache of the decoding batch unpadded or not (after the batch's rows
    changed: a joining row may bring padding, a leaving one may take it away). Reads the padding
    to the host, so only when the rows change."""
    for cache in layer_caches:
        if type(cache) not in (BatchKVCache, UnpaddedBatchKVCache):
            continue  # rotating and other caches keep their own masks
        recast(cache, UnpaddedBatchKVCache if unpadded(cache) else BatchKVCache)
