"""The `generate` request as a type: every field once, with its wire name, its type and the rule
its wire value must follow.

The daemon's edge builds a GenerateRequest once, when it validates a frame (validation.py's
`validate_generate`); the engine reads its attributes. Clients and the gateway build one and send
`to_wire()`. A field left at its default is left off the wire, so the map a client sends carries
only what it chose.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .constraints import FormatType, ToolChoice
from .messages import MessageType
from .messages import request as wire_request
from .rules import (
    MAX_ID_CHARS,
    AnyChoice,
    AnyList,
    AnyMap,
    Bool,
    Duration,
    Int,
    Number,
    Rule,
    Str,
    TokenIds,
)
from .units import KeepAliveDuration

RequestId = str | int  # client-chosen; unique per connection while the request runs
MAX_SALT_CHARS = 1024  # a cache_salt: vLLM suggests 43 characters (256 random bits, base64)
# JSON values as the codec decoded them (chat turns, tool specs, schemas): passed on, never changed.
JsonMap = Mapping[str, Any]
TemplateValue = bool | int | float | str | None


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output: any JSON object, or JSON that validates against `schema`."""

    type: FormatType
    schema: JsonMap | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type.value}
        if self.schema is not None:
            out["schema"] = self.schema
        return out

    @classmethod
    def from_wire(cls, value: JsonMap) -> ResponseFormat:
        return cls(FormatType(value["type"]), value.get("schema"))


@dataclass(frozen=True)
class NamedTool:
    """A `tool_choice` that forces one call of the function named."""

    name: str

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name}


def _tool_choice(value: Any) -> ToolChoice | NamedTool:
    return NamedTool(value["name"]) if isinstance(value, dict) else ToolChoice(value)


def _field(rule: Rule, default: Any = None, decode: Callable[[Any], Any] | None = None) -> Any:
    """A generate field: its default (left off the wire), its rule, and how a checked wire value
    becomes the attribute (as it is, when no `decode`)."""
    return dataclasses.field(default=default, metadata={"rule": rule, "decode": decode})


@dataclass(frozen=True)
class GenerateRequest:
    """One generation, as the daemon runs it. Give exactly one of prompt, prompt_ids, messages."""

    prompt: str | None = _field(Str(max_chars=4 * 1024 * 1024, non_empty=True))
    prompt_ids: tuple[int, ...] | None = _field(TokenIds(non_empty=True), decode=tuple)
    resume_ids: tuple[int, ...] = _field(TokenIds(), (), tuple)  # tokens a broken stream had
    max_tokens: int | None = _field(Int(lo=1))  # over limits.max_tokens: capped, `done` says so
    # ... unless strict: a max_tokens the limits or the context cannot hold is refused, with the
    # numbers (a gateway's 400 in its API's words, no count_tokens before every request)
    strict_max_tokens: bool = _field(Bool(), False)
    # Without max_tokens: run to the end of turn or of the context (limits.max_tokens), as
    # OpenAI's and ollama's servers run a request that names no limit, not default_max_tokens.
    open_ended: bool = _field(Bool(), False)
    temperature: float | None = _field(Number(lo=0.0, hi=100.0))
    top_p: float | None = _field(Number(lo=0.0, hi=1.0, lo_open=True))
    seed: int | None = _field(Int(lo=0))
    raw: bool = _field(Bool(), False)  # the prompt as it is, no chat template
    model: str | None = _field(Str())
    trace: bool = _field(Bool(), False)  # the router trace streamed back
    progress: bool = _field(Bool(), False)  # `progress` messages while the prompt is read
    telemetry_every: int | None = _field(Int(lo=1, hi=2**31 - 1))
    messages: tuple[JsonMap, ...] | None = _field(AnyList(), decode=tuple)  # chat turns
    tools: tuple[JsonMap, ...] = _field(AnyList(), (), tuple)  # function specs for the template
    stop: tuple[str, ...] = _field(AnyList(), (), tuple)  # the text ends before the first match
    logprobs: int | None = _field(Int(lo=0))  # per-token logprobs with this many alternatives
    # How long the model stays loaded after it (ValueError building one that is not a duration).
    keep_alive: KeepAliveDuration | None = _field(Duration(), decode=KeepAliveDuration)
    # Constrained decoding and template switches (protocol/constraints.py checks their contents).
    format: ResponseFormat | None = _field(AnyMap(), decode=ResponseFormat.from_wire)
    tool_choice: ToolChoice | NamedTool | None = _field(AnyChoice(), decode=_tool_choice)
    parallel_tool_calls: bool | None = _field(Bool())  # false: at most one tool call
    chat_template_kwargs: Mapping[str, TemplateValue] | None = _field(AnyMap())
    # The prefix cache's scope: requests resume only from prefixes cached under the same
    # principal and salt. `principal`: who sent it, set by a gateway that serves several (an API
    # key's identity, a peer's uid); `cache_salt`: the client's own separation (vLLM's field).
    principal: str | None = _field(Str(max_chars=MAX_ID_CHARS, non_empty=True))
    cache_salt: str | None = _field(Str(max_chars=MAX_SALT_CHARS, non_empty=True))
    # Who the request is for behind a connection that serves many (the gateway: its HTTP
    # caller's address): rows and grammar compiles go in turn across (connection, caller).
    caller: str | None = _field(Str(max_chars=256))

    def to_wire(self, request_id: str | int) -> dict[str, Any]:
        """The `generate` message of this request; fields at their default are left off."""
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                fields[f.name] = _wire_value(value)
        return wire_request(MessageType.GENERATE, request_id, **fields)

    @classmethod
    def from_checked(cls, msg: JsonMap) -> GenerateRequest:
        """The request of a map whose fields passed their rules and cross-checks (validation.py
        calls this; a `count_tokens` carries a generate's prompt fields, under the same rules)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = msg.get(f.name)
            if value is not None:
                decode = f.metadata["decode"]
                values[f.name] = value if decode is None else decode(value)
        return cls(**values)

    @property
    def template_tools(self) -> tuple[JsonMap, ...] | None:
        """The tools the chat template (and the tool-call parser) is told of: none with
        tool_choice none, as OpenAI's API means it."""
        return None if self.tool_choice is ToolChoice.NONE or not self.tools else self.tools

    @property
    def templated(self) -> bool:
        """Whether the prompt goes through the chat template (then the template's markers count)."""
        return self.messages is not None or (self.prompt is not None and not self.raw)

    @property
    def forced_tool_calls(self) -> bool:
        """The answer must be tool calls (tool_choice required, or a named function)."""
        return isinstance(self.tool_choice, NamedTool) or self.tool_choice is ToolChoice.REQUIRED


def _wire_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, ResponseFormat | NamedTool | KeepAliveDuration):
        return value.to_wire()
    return value


# The generate rows of the validation table: one per field, from the type.
GENERATE_FIELDS: dict[str, Rule] = {
    f.name: f.metadata["rule"] for f in dataclasses.fields(GenerateRequest)
}
