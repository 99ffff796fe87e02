"""A generation as the clients take it: GenerateRequest's fields in their wire form, checked here
as the daemon's edge checks them (without the model's limits), so a bad field fails at once with
the daemon's own code and message."""

from __future__ import annotations

from typing import Any

from moed.protocol import RETRYABLE, GenerateRequest, MessageType, ProtocolError, validate_generate
from moed.protocol import messages as wire
from moed.protocol.generate import GENERATE_FIELDS

from .errors import RequestFailed

_LOCAL_ID = "local"  # the frame is only checked here; the client sends it under its own id


def checked_request(**fields: Any) -> GenerateRequest:
    """The typed request of `fields` (None: not given); RequestFailed for a bad value."""
    unknown = fields.keys() - GENERATE_FIELDS.keys()
    if unknown:
        raise TypeError(f"not a generate field: {', '.join(sorted(unknown))}")
    try:
        return validate_generate(wire.request(MessageType.GENERATE, _LOCAL_ID, **fields))
    except ProtocolError as exc:
        raise RequestFailed(
            exc.code, exc.message, exc.code in RETRYABLE, exc.wire_fields().get("budget")
        ) from None
