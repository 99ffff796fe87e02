"""Admission rules of a generate that depend on the daemon, not on the message alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moed.protocol import ErrorCode, ProtocolError


class DuplicateId(ProtocolError):
    """A generate id already in flight on the connection: answered with `id: nil` and `target`,
    so that a client routing by id does not take it for the running stream's end."""

    def __init__(self, request_id: Any):
        super().__init__(ErrorCode.DUPLICATE_ID, f"request id {request_id!r} is already in flight")
        self.target = request_id


def check_model_name(name: str | None, configured: str, model_path: Path) -> None:
    """`model` may name the configured model, its folder's path or the folder's name."""
    if not name:
        return
    if name not in {configured, str(model_path), model_path.name}:
        raise ProtocolError(
            ErrorCode.MODEL_NOT_FOUND,
            f"model {name!r} is not served here; this daemon serves {configured!r} "
            f"(also known as {model_path.name!r})",
        )
