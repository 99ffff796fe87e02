"""The prefix KV cache: a request whose tokens begin with a cached prefix reads only the rest.

entry.py (one cached prefix, cutting it back, checkpoints), memory_tier.py (LRU under a byte
budget), disk_tier.py (the SSD tier: fingerprinted safetensors files, written off the engine
thread), cache.py (both tiers behind lookup / store), setup.py (built from the serve settings).
"""

from moed.daemon.engine.prefix_cache.cache import PrefixCache, PrefixCacheConfig, PrefixHit

__all__ = ["PrefixCache", "PrefixCacheConfig", "PrefixHit"]
