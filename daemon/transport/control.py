"""Who may use the control verbs that affect other clients (`shed`, `shutdown`).

At bind the daemon writes a random token beside the socket (`<socket>.token`, mode 0600, in the
0700 socket directory): whoever can read it is the daemon's owner (the `moe` CLI, the watchdog).
A client that only relays requests (an HTTP gateway) never has it, so its users cannot stop the
daemon or shed another's stream. Cancel needs no token: it only reaches the sender's own streams.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path

from moed.protocol import ErrorCode, ProtocolError
from moed.protocol.paths import control_token_path

log = logging.getLogger("moed.server")


class ControlToken:
    def __init__(self, socket_path: Path):
        self.path = control_token_path(socket_path)
        self.value = secrets.token_hex(16)

    def write(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.value)

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def require(self, verb: str, given: object) -> None:
        if not isinstance(given, str) or not hmac.compare_digest(given, self.value):
            raise ProtocolError(
                ErrorCode.NOT_PERMITTED,
                f"{verb} affects other clients: only the daemon's owner (the token in "
                f"{self.path.name}) or the watchdog may send it",
            )
