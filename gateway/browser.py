"""The gateway as a local web service that a browser cannot be turned against: any web page can
make the browser send requests to 127.0.0.1, so

- only Host names that are loopback (or configured) are served: a page whose own name was made
  to resolve to 127.0.0.1 (DNS rebinding) sends its own name as Host and is refused;
- a state-changing request (any method but GET, HEAD, OPTIONS) from a foreign Origin is refused
  before it runs, whatever its content type: a `text/plain` POST needs no preflight, so CORS
  alone would let it run and only hide the answer.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from .errors import ApiError, ErrorKind

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def host_name(host: str) -> str:
    """Host minus port, lower case: `[::1]:80` -> `[::1]`, `LOCALHOST.:80` -> `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        name = host[: host.find("]") + 1] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.rstrip(".")


def _as_host(name: str) -> str:
    """A configured name as host_name spells a Host header's: an IPv6 address in brackets."""
    try:
        ipaddress.IPv6Address(name)
    except ValueError:
        return host_name(name)
    return f"[{name.lower()}]"


def _is_loopback_name(name: str) -> bool:
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


class BrowserGuard:
    def __init__(self, allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...]):
        self.any_host = "*" in allowed_hosts
        self.allowed_hosts = frozenset(_as_host(h) for h in allowed_hosts if h != "*")
        self.any_origin = "*" in cors_origins
        self.cors_origins = frozenset(o.rstrip("/").lower() for o in cors_origins)

    def refusal(self, method: str, headers: dict[bytes, bytes]) -> ApiError | None:
        host = headers.get(b"host", b"").decode("latin-1")
        name = host_name(host)
        if not self.any_host and not (_is_loopback_name(name) or name in self.allowed_hosts):
            return ApiError(
                ErrorKind.FORBIDDEN,
                f"Host {host!r} is not served (loopback names only; add it with --allow-host)",
            )
        origin = headers.get(b"origin")
        if origin is None or method in SAFE_METHODS or self.any_origin:
            return None
        text = origin.decode("latin-1").rstrip("/").lower()
        if text in self.cors_origins or _same_origin(text, host):
            return None
        return ApiError(
            ErrorKind.FORBIDDEN,
            f"a {method} from the web page at {text!r} is refused "
            "(allow its origin with --cors-origin)",
        )


def _same_origin(origin: str, host: str) -> bool:
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc == host.strip().lower()
