"""What the daemon streams back for one `generate`, as types: the engine emits these, the transport
encodes them with `to_wire(request_id)`, the clients read them with `from_wire`.

Each `to_wire` builds the map PROTOCOL.md describes through the builders in messages.py (the wire
format lives there once); each `from_wire` reads such a map, as lenient as the clients always were
with what a daemon leaves off. The request id is not part of an event: the engine knows it per
request and the client per stream, as `GenerateRequest.to_wire(request_id)` takes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from . import messages
from .errors import RETRYABLE, ErrorCode, ProtocolError
from .generate import RequestId
from .messages import PROMPT_STAGE, Channel, FinishReason, Message, MessageType
from .version import PROTOCOL_MAJOR

WireMap = Mapping[str, Any]
_Enum = TypeVar("_Enum", bound=StrEnum)


def _known(kind: type[_Enum], raw: Any) -> _Enum | str:
    """`raw` as a member of `kind`, or kept as its string: a newer daemon's value (a finish
    reason, a channel) never fails the stream that carries it."""
    text = str(raw)
    return kind(text) if text in kind._value2member_map_ else text


@dataclass(frozen=True)
class TokenEvent:
    """Text of one token (or of one channel segment of it): `ids` on the first segment only."""

    index: int
    ids: list[int]
    text: str
    # Per token of `ids` when the request asked for logprobs: {id, token, logprob, top: [...]}.
    logprobs: list[dict[str, Any]] | None = None
    # Tool calls the model finished with this token: {id, name, arguments (a map)}.
    tool_calls: list[dict[str, Any]] | None = None
    # Which part of the turn the text is: the answer, or reasoning (between the think markers).
    channel: Channel | str = Channel.ANSWER  # a string: a newer daemon's channel

    def to_wire(self, request_id: RequestId) -> Message:
        return messages.token(
            request_id,
            self.index,
            self.ids,
            self.text,
            self.logprobs,
            self.tool_calls or None,  # an empty list is left off the wire, as no list
            self.channel,
        )

    @classmethod
    def from_wire(cls, msg: WireMap) -> TokenEvent:
        return cls(
            int(msg["index"]),
            list(msg["ids"]),
            str(msg["text"]),
            msg.get("logprobs"),
            msg.get("tool_calls") or None,
            _known(Channel, msg.get("channel") or Channel.ANSWER.value),
        )


@dataclass(frozen=True)
class PromptProgress:
    """How many of the prompt's tokens (its context: prompt and resumed tokens) were read; a
    `progress` message of stage `reading the prompt`, unit `tokens`."""

    done: int
    total: int
    # What a client reads of any progress event; fixed for the prompt's (not fields: not passed).
    stage: ClassVar[str] = PROMPT_STAGE
    unit: ClassVar[str] = "tokens"

    def to_wire(self, request_id: RequestId) -> Message:
        return messages.prompt_progress(request_id, self.done, self.total)

    @classmethod
    def from_wire(cls, msg: WireMap) -> PromptProgress:
        return cls(int(msg.get("done") or 0), int(msg.get("total") or 0))


@dataclass(frozen=True)
class LoadProgress:
    """How far the (re)load of the model is that this request waits for: a stage (`reading the
    checkpoint`, `loading weights`, ...), done of total (None: not known) in `unit`."""

    stage: str
    done: float
    total: float | None
    unit: str  # "bytes" or "steps"

    def to_wire(self, request_id: RequestId) -> Message:
        return messages.progress(request_id, self.stage, self.done, self.total, self.unit)

    @classmethod
    def from_wire(cls, msg: WireMap) -> LoadProgress:
        return cls(
            str(msg.get("stage", "")),
            float(msg.get("done") or 0),
            msg.get("total"),
            str(msg.get("unit", "steps")),
        )


# The one `progress` message type carries both; a client tells them apart by stage (or type).
ProgressEvent = PromptProgress | LoadProgress


def progress_from_wire(msg: WireMap) -> ProgressEvent:
    if msg.get("stage") == PROMPT_STAGE and msg.get("unit") == PromptProgress.unit:
        return PromptProgress.from_wire(msg)
    return LoadProgress.from_wire(msg)


@dataclass(frozen=True)
class TelemetryEvent:
    """Live numbers every `telemetry_every` tokens (or a `warning` about the request's trace)."""

    data: dict[str, Any]

    def to_wire(self, request_id: RequestId) -> Message:
        return messages.telemetry(request_id, self.data)

    @classmethod
    def from_wire(cls, msg: WireMap) -> TelemetryEvent:
        return cls(msg.get("data") or {})


@dataclass(frozen=True)
class TraceEvent:
    """The next bytes of the request's router trace (concatenated in order they form the file)."""

    seq: int
    data: bytes

    def to_wire(self, request_id: RequestId) -> Message:
        return messages.trace_chunk(request_id, self.seq, self.data)

    @classmethod
    def from_wire(cls, msg: WireMap) -> TraceEvent:
        return cls(int(msg.get("seq", 0)), bytes(msg.get("data") or b""))


@dataclass(frozen=True)
class DoneEvent:
    """The request ended well (the last message of its stream)."""

    finish_reason: FinishReason | str  # a string: a newer daemon's reason
    usage: dict[str, Any]
    timings: dict[str, Any]
    telemetry: dict[str, Any] = field(default_factory=dict)
    stop_sequence: str | None = None  # the stop string that ended the text (finish_reason "stop")
    # K-reduction was on (lossy): {active_experts, native_experts, lossy}; None: native routing.
    lossy: dict[str, Any] | None = None
    notice: str | None = None  # the daemon changed the request, e.g. capped max_tokens

    def to_wire(self, request_id: RequestId) -> Message:
        return messages.done(
            request_id,
            self.finish_reason,
            self.usage,
            self.timings,
            telemetry=self.telemetry,
            stop_sequence=self.stop_sequence,
            notice=self.notice,
            lossy=self.lossy,
        )

    @classmethod
    def from_wire(cls, msg: WireMap) -> DoneEvent:
        return cls(
            _known(FinishReason, msg["finish_reason"]),
            msg.get("usage") or {},
            msg.get("timings") or {},
            msg.get("telemetry") or {},
            msg.get("stop_sequence"),
            msg.get("lossy"),
            msg.get("notice"),
        )


@dataclass(frozen=True)
class FailedEvent:
    """The request ended with a typed error (the last message of its stream)."""

    # A code this version does not know (a newer daemon's) is kept as its string.
    code: ErrorCode | str
    message: str
    retryable: bool
    # A refused prompt or max_tokens: {prompt_tokens, max_tokens?, limit}.
    budget: dict[str, Any] | None = None

    @classmethod
    def of(cls, code: ErrorCode, message: str) -> FailedEvent:
        return cls(code, message, code in RETRYABLE)

    @classmethod
    def refusal(cls, exc: ProtocolError) -> FailedEvent:
        """The error answering a refused request, with what the refusal carries (a `budget`)."""
        return cls(exc.code, exc.message, exc.code in RETRYABLE, exc.wire_fields().get("budget"))

    def to_wire(self, request_id: RequestId) -> Message:
        msg: Message = {
            "v": PROTOCOL_MAJOR,
            "type": MessageType.ERROR.value,
            "id": request_id,
            "code": self.code.value if isinstance(self.code, ErrorCode) else self.code,
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.budget is not None:
            msg["budget"] = self.budget
        return msg

    @classmethod
    def from_wire(cls, msg: WireMap) -> FailedEvent:
        raw = msg.get("code")
        code: ErrorCode | str = str(raw)
        if raw in ErrorCode._value2member_map_:
            code = ErrorCode(raw)
        budget = msg.get("budget")
        return cls(
            code,
            str(msg.get("message", "")),
            bool(msg.get("retryable")),
            budget if isinstance(budget, dict) else None,
        )


EngineEvent = (
    TokenEvent
    | PromptProgress
    | LoadProgress
    | TelemetryEvent
    | TraceEvent
    | DoneEvent
    | FailedEvent
)
# The events that end a request's stream.
TERMINAL_EVENTS = (DoneEvent, FailedEvent)

_READERS: dict[str, Callable[[WireMap], EngineEvent]] = {
    MessageType.TOKEN.value: TokenEvent.from_wire,
    MessageType.PROGRESS.value: progress_from_wire,
    MessageType.TELEMETRY.value: TelemetryEvent.from_wire,
    MessageType.TRACE.value: TraceEvent.from_wire,
    MessageType.DONE.value: DoneEvent.from_wire,
    MessageType.ERROR.value: FailedEvent.from_wire,
}


def event_from_wire(msg: WireMap) -> EngineEvent | None:
    """The event a generation stream's message carries; None for a type this version does not
    know (a newer daemon's)."""
    reader = _READERS.get(str(msg.get("type")))
    return reader(msg) if reader is not None else None
