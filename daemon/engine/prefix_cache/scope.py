"""Whose a cached prefix is: the scope a request's entries are kept and found under.

A cached prefix answers faster and says so (`cached_tokens`, time to first token), so a client
that can resume from another client's entries learns what that client sent. The scope keeps
principals apart: the `principal` a gateway serving several of them names (an API key's identity,
a peer's uid) and a request's `cache_salt` (vLLM's field: requests with different salts never
share a cached prefix). Both absent: the one default scope, every client of the daemon's user
(single-user behaviour). The scope is a digest, so neither the salt nor the principal is kept in
memory beside the entries or written into the SSD tier's files.
"""

from __future__ import annotations

import hashlib

DEFAULT_SCOPE = ""


def cache_scope(principal: str | None, cache_salt: str | None) -> str:
    """The scope of a request: DEFAULT_SCOPE without principal and salt, else a digest of both
    (length-prefixed: no two pairs run together into one)."""
    if principal is None and cache_salt is None:
        return DEFAULT_SCOPE
    parts = [principal, cache_salt]
    text = "".join("-" if p is None else f"{len(p)}:{p}" for p in parts)
    return hashlib.sha256(f"moed cache scope\0{text}".encode()).hexdigest()[:32]
