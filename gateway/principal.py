"""Who a request comes from, as the daemon's prefix cache scopes its entries (the `principal` of
`generate`): a client that could resume from another principal's cached prefixes would learn
their prompts from `cached_tokens` and from the time to the first token.

One principal by default: the daemon's own user, whether it comes through the gateway without a
key, with the one key of --api-key-file or with the key --local-auth key writes. Where one gateway
serves several: each key of an --api-key-file that holds several is a principal (named by a digest
of the key, never the key), and with --local-auth off each other local user is one (by uid).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from starlette.requests import Request
from starlette.types import Scope

from .config import is_loopback
from .peer import peer_uid

SCOPE_KEY = "moed.principal"  # where the guard leaves it in the ASGI scope


def key_principal(key: bytes) -> str:
    """A key's principal: a digest, so the key itself never leaves the gateway."""
    return "key:" + hashlib.sha256(b"moed principal\0" + key).hexdigest()[:16]


def matching_key(given: bytes, keys: tuple[bytes, ...]) -> bytes | None:
    """The key `given` is, compared with every key in constant time (which one matched, and
    whether any did, take the same time)."""
    found = None
    for key in keys:
        if hmac.compare_digest(given, key):
            found = key
    return found


def peer_principal(scope: Scope) -> str | None:
    """With --local-auth off: another local user (by uid) is a principal of their own; this
    user is the default one."""
    client, server = scope.get("client"), scope.get("server")
    uid = peer_uid(client, server) if client and server and is_loopback(client[0]) else None
    if uid == os.getuid():
        return None
    return f"uid:{uid}" if uid is not None else "uid:unknown"


def principal_of(request: Request) -> str | None:
    """The principal the guard found for this request (None: the default one)."""
    value = request.scope.get(SCOPE_KEY)
    return value if isinstance(value, str) else None
