"""Who is on the other end of a loopback connection: the user that owns the peer's socket.

The daemon's socket sits in a 0700 directory, so only its user can reach it; a keyless loopback
gateway must keep that boundary. On Linux the kernel knows both ends of a loopback TCP connection
and their owners' uids (sock_diag, as `ss` asks; /proc/net/tcp as a fallback), so the peer's
address and port name its user. macOS has no such table an unprivileged process can read
cheaply, so there the gateway uses a key instead (LocalAuth.KEY: config.py writes it mode 0600
beside the daemon's socket).
"""

from __future__ import annotations

import enum
import ipaddress
import socket
import struct
import sys
from pathlib import Path

PROC_NET = Path("/proc/net")
IP = ipaddress.IPv4Address | ipaddress.IPv6Address


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


# sock_diag (as `ss` uses): one exact lookup by the connection's four-tuple, answered in
# microseconds; /proc/net/tcp walks the kernel's whole socket hash (about 14 ms measured here).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSG = struct.Struct("=IHHII")
_DIAG_REQ = struct.Struct("=BBBBI")  # family, protocol, ext, pad, states; then the socket id
_SOCK_ID = struct.Struct(">HH16s16s")  # ports are big-endian, addresses network order
_SOCK_ID_TAIL = struct.Struct("=III")  # interface, cookie (none: ~0, ~0)
_UID_OFFSET = 4 + _SOCK_ID.size + _SOCK_ID_TAIL.size + 12  # inet_diag_msg.idiag_uid


def _diag_uid(local: tuple[IP, int], remote: tuple[IP, int]) -> int | None:
    """The uid of the TCP socket bound at `local` and connected to `remote`, asked of the kernel
    by sock_diag; None if it has no such socket. Raises OSError where sock_diag is missing."""
    family = socket.AF_INET if local[0].version == 4 else socket.AF_INET6
    request = (
        _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
        + _SOCK_ID.pack(
            local[1], remote[1], local[0].packed.ljust(16, b"\0"), remote[0].packed.ljust(16, b"\0")
        )
        + _SOCK_ID_TAIL.pack(0, 0xFFFFFFFF, 0xFFFFFFFF)
    )
    header = _NLMSG.pack(_NLMSG.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.send(header + request)
        reply = nl.recv(8192)
    length, kind = _NLMSG.unpack_from(reply)[:2]
    if kind == _NLMSG_ERROR:
        errno = -struct.unpack_from("=i", reply, _NLMSG.size)[0]
        if errno == 2:  # ENOENT: no such connection
            return None
        raise OSError(errno, "sock_diag refused the lookup")
    if kind != _SOCK_DIAG_BY_FAMILY or length < _NLMSG.size + _UID_OFFSET + 4:
        raise OSError("sock_diag answered something else")
    return struct.unpack_from("=I", reply, _NLMSG.size + _UID_OFFSET)[0]


def _hex_address(ip: IP, port: int) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word in host byte order, then port."""
    packed = ip.packed
    words = (int.from_bytes(packed[i : i + 4], sys.byteorder) for i in range(0, len(packed), 4))
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _address(host: str) -> IP:
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # an IPv4 client of a dual-stack listener: its socket is in tcp
    return ip


def peer_uid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid owning the socket at `client` that is connected to `server`, or None when it is not
    found (another network namespace, a connection already gone, no /proc)."""
    try:
        peer, local = (_address(client[0]), client[1]), (_address(server[0]), server[1])
    except ValueError:
        return None
    if peer[0].version != local[0].version:
        return None
    try:
        return _diag_uid(peer, local)
    except OSError:  # no sock_diag (an old kernel, a sandbox): the slow table
        return _proc_uid(peer, local)


def _proc_uid(local: tuple[IP, int], remote: tuple[IP, int]) -> int | None:
    """As _diag_uid, from /proc/net/tcp (tcp6): the line whose two ends are these."""
    want_local, want_remote = _hex_address(*local), _hex_address(*remote)
    table = PROC_NET / ("tcp" if local[0].version == 4 else "tcp6")
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote:
            return int(fields[7])
    return None
