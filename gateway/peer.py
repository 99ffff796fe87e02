"""Who is on the other end of a loopback connection: the user that owns the peer's socket.

The daemon's socket sits in a 0700 directory, so only its user can reach it; a keyless loopback
gateway must keep that boundary. On Linux both ends of a loopback TCP connection are listed in
/proc/net/tcp (tcp6) with their owner's uid, so the peer's address and port name its user. macOS
has no such table an unprivileged process can read cheaply, so there the gateway uses a key
instead (LocalAuth.KEY: config.py writes it mode 0600 beside the daemon's socket).
"""

from __future__ import annotations

import enum
import ipaddress
import sys
from pathlib import Path

PROC_NET = Path("/proc/net")


class LocalAuth(str, enum.Enum):
    """How a keyless loopback gateway tells the daemon's user from other local users."""

    AUTO = "auto"  # UID where the kernel lists sockets' owners (Linux), else KEY
    UID = "uid"  # the peer's uid must be the gateway's own
    KEY = "key"  # a generated key file (mode 0600) that clients send as their API key
    OFF = "off"  # any local user (the daemon's trust boundary is given up)

    def resolved(self) -> LocalAuth:
        if self is not LocalAuth.AUTO:
            return self
        return LocalAuth.UID if (PROC_NET / "tcp").exists() else LocalAuth.KEY


def _hex_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word in host byte order, then port."""
    packed = ip.packed
    words = (int.from_bytes(packed[i : i + 4], sys.byteorder) for i in range(0, len(packed), 4))
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # an IPv4 client of a dual-stack listener: its socket is in tcp
    return ip


def peer_uid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid owning the socket at `client` that is connected to `server`, or None when it is not
    found (another network namespace, a connection already gone, no /proc)."""
    try:
        peer, local = _address(client[0]), _address(server[0])
    except ValueError:
        return None
    if peer.version != local.version:
        return None
    want_local, want_remote = _hex_address(peer, client[1]), _hex_address(local, server[1])
    table = PROC_NET / ("tcp" if peer.version == 4 else "tcp6")
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote:
            return int(fields[7])
    return None
