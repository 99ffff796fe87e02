"""The trust boundary: every field of every request checked for type and range, in one table.

A request is checked twice, both times here: `validate_request` on the raw map (types, ranges, the
loaded model's vocabulary and context when the daemon passes its `Limits`), and `check_context`
once the prompt is tokenized (non-empty, prompt plus `max_tokens` within the context). Nothing that
fails either reaches MLX. A generate's checked map becomes its typed GenerateRequest here, once
(`validate_generate`). To add a generate field, add it to GenerateRequest (generate.py: its type
and rule together); a control message's field, a row to FIELDS; a cross-field rule, a function in
CROSS_CHECKS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .chat import prompt_sources, validate_chat_fields
from .constraints import validate_constraint_fields, validate_template_kwargs
from .errors import BudgetExceeded, ErrorCode, ProtocolError
from .generate import GENERATE_FIELDS, GenerateRequest
from .messages import (
    REQUEST_TYPES,
    Message,
    MessageType,
    ModelsAction,
    PrefixCacheAction,
    ShedLevel,
)
from .rules import (
    Bool,
    Int,
    Limits,
    OneOf,
    RequestId,
    Rule,
    Str,
    refuse,
)
from .version import PROTOCOL_MAJOR

# Unknown fields are ignored (a newer client may send more); known ones must be right.
FIELDS: dict[MessageType, dict[str, Rule]] = {
    MessageType.HELLO: {"client": Str()},
    MessageType.GENERATE: GENERATE_FIELDS,
    MessageType.CANCEL: {"target": RequestId(required=True)},
    MessageType.STATUS: {},
    MessageType.STATS: {},
    MessageType.METRICS: {},
    MessageType.SHED: {"level": OneOf(choices=ShedLevel), "reason": Str(), "token": Str()},
    MessageType.SHUTDOWN: {"reason": Str(), "restart": Bool(), "token": Str()},
    MessageType.PING: {},
    MessageType.PREFIX_CACHE: {
        "action": OneOf(choices=PrefixCacheAction),
        "token": Str(),
        "model": Str(max_chars=4096),
    },
    MessageType.MODELS: {"action": OneOf(choices=ModelsAction), "model": Str(max_chars=4096)},
    # A generate's prompt fields, under the same rules (an empty prompt counts 0 tokens here).
    MessageType.COUNT_TOKENS: {
        "prompt": Str(max_chars=4 * 1024 * 1024),
        **{name: GENERATE_FIELDS[name] for name in ("messages", "tools", "raw")},
        "chat_template_kwargs": GENERATE_FIELDS["chat_template_kwargs"],
    },
}


def _one_prompt(msg: Message, limits: Limits | None) -> None:
    if len(prompt_sources(msg)) != 1:
        refuse("generate", "give exactly one of 'prompt', 'prompt_ids' or 'messages'")
    validate_chat_fields(msg)


def _count_tokens_prompt(msg: Message, limits: Limits | None) -> None:
    if len(prompt_sources(msg)) != 1 or msg.get("prompt_ids") is not None:
        refuse("count_tokens", "give exactly one of 'prompt' or 'messages'")
    validate_chat_fields(msg, "count_tokens")
    if msg.get("chat_template_kwargs") is not None:
        validate_template_kwargs(msg["chat_template_kwargs"])


def _prompt_chars(msg: Message, limits: Limits | None) -> None:
    # A cheap bound before tokenizing (count_tokens tokenizes on the transport thread): a token
    # is rarely more than 32 characters.
    if limits is None:
        return
    chars = len(msg.get("prompt") or "")
    if isinstance(msg.get("messages"), list):
        chars += sum(
            len(turn.get("content") or "")
            for turn in msg["messages"]
            if isinstance(turn, dict) and isinstance(turn.get("content"), str)
        )
    if chars > limits.max_prompt_tokens * 32:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt of {chars} characters is over {limits.max_prompt_tokens} tokens",
        )


def _ids_within_context(msg: Message, limits: Limits | None) -> None:
    if limits is None or msg.get("prompt_ids") is None:
        return  # a text prompt is checked once tokenized (check_context)
    prompt = len(msg["prompt_ids"])
    open_ended = bool(msg.get("open_ended"))
    max_tokens = resolve_max_tokens(msg.get("max_tokens"), prompt, limits, open_ended)
    check_context(prompt, len(msg.get("resume_ids") or []), max_tokens, limits)
    if msg.get("strict_max_tokens"):
        check_max_tokens(msg.get("max_tokens"), prompt, limits)


CROSS_CHECKS: dict[MessageType, list[Callable[[Message, Limits | None], None]]] = {
    MessageType.GENERATE: [
        _one_prompt,
        _prompt_chars,
        _ids_within_context,
        validate_constraint_fields,
    ],
    MessageType.COUNT_TOKENS: [_count_tokens_prompt, _prompt_chars],
}


def validate_request(msg: Any, limits: Limits | None = None) -> tuple[MessageType, Any]:
    """Check a decoded map against the schema; return its type and id or raise ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "a message must be a msgpack map")
    if msg.get("id") is not None:
        RequestId().check("'id'", msg["id"], limits)
    version = msg.get("v")
    if version is None:
        refuse("'v'", "the protocol major version is required")
    if isinstance(version, float) and version == PROTOCOL_MAJOR:
        refuse(
            "'v'", f"must be a msgpack integer; got the float {version!r}, send {PROTOCOL_MAJOR}"
        )
    Int(lo=0).check("'v'", version, limits)
    if version != PROTOCOL_MAJOR:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} is not supported; this daemon speaks {PROTOCOL_MAJOR}",
        )
    try:
        kind = MessageType(msg.get("type"))
    except ValueError:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg.get('type')!r:.60}"
        ) from None
    if kind not in REQUEST_TYPES:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{kind.value!r} is not a request type")
    if msg.get("id") is None:
        refuse("'id'", "is required")
    for name, rule in FIELDS[kind].items():
        value = msg.get(name)
        if value is None:
            if rule.required:
                refuse(f"{kind.value}: field {name!r}", "is required")
            continue
        rule.check(f"{kind.value}: field {name!r}", value, limits)
    for check in CROSS_CHECKS.get(kind, ()):
        check(msg, limits)
    return kind, msg["id"]


def validate_generate(msg: Any, limits: Limits | None = None) -> GenerateRequest:
    """A `generate` frame checked as `validate_request` checks it, returned as its typed request:
    the one way a wire map becomes the GenerateRequest the engine runs."""
    kind, _ = validate_request(msg, limits)
    if kind is not MessageType.GENERATE:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{kind.value!r} is not a generate")
    return GenerateRequest.from_checked(msg)


def is_generate(msg: Any) -> bool:
    """Whether a decoded frame says it is a generate (`validate_generate` then checks all of it)."""
    return isinstance(msg, dict) and msg.get("type") == MessageType.GENERATE.value


def resolve_max_tokens(
    requested: int | None, prompt_tokens: int, limits: Limits, open_ended: bool = False
) -> int:
    """The `max_tokens` a generation runs with: as asked (or, unasked, the default; open-ended,
    the limit), capped to the limit and to the context left after the prompt. The `done` of a
    capped request carries a notice."""
    room = (limits.context_tokens or math.inf) - prompt_tokens
    unasked = limits.max_tokens if open_ended else limits.default_max_tokens
    asked = unasked if requested is None else requested
    return int(max(1, min(asked, limits.max_tokens, room)))


def check_context(prompt_tokens: int, resume_tokens: int, max_tokens: int, limits: Limits) -> None:
    """After tokenizing: a non-empty prompt within max_prompt_tokens that leaves the context room
    for one more token, and resumed tokens short of `max_tokens` (which counts them: a resume
    continues the same completion)."""
    if prompt_tokens < 1:
        refuse("generate", "the prompt is empty after templating and tokenizing")
    total = prompt_tokens + resume_tokens
    if total > limits.max_prompt_tokens:
        raise BudgetExceeded(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt is {total} tokens; this daemon accepts at most {limits.max_prompt_tokens}",
            total,
            None,
            limits.max_prompt_tokens,
        )
    context = limits.context_tokens
    if context is not None and total + 1 > context:
        raise BudgetExceeded(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt ({prompt_tokens} tokens) and resume_ids ({resume_tokens}) leave no room in "
            f"the model's context of {context} tokens",
            total,
            None,
            context - 1,
        )
    if resume_tokens >= max_tokens:
        refuse("generate", f"resume_ids ({resume_tokens}) already reach max_tokens ({max_tokens})")


def check_max_tokens(requested: int | None, prompt_tokens: int, limits: Limits) -> None:
    """`strict_max_tokens`: a max_tokens over limits.max_tokens or past the context left after
    the prompt is refused with the numbers, where resolve_max_tokens would cap it."""
    if requested is None:
        return
    if requested > limits.max_tokens:
        raise BudgetExceeded(
            ErrorCode.MAX_TOKENS_TOO_LARGE,
            f"max_tokens {requested} is over this daemon's limit of {limits.max_tokens}",
            prompt_tokens,
            requested,
            limits.max_tokens,
        )
    context = limits.context_tokens
    if context is not None and prompt_tokens + requested > context:
        raise BudgetExceeded(
            ErrorCode.CONTEXT_EXCEEDED,
            f"prompt ({prompt_tokens} tokens) + max_tokens ({requested}) is over the model's "
            f"context of {context} tokens",
            prompt_tokens,
            requested,
            context,
        )


def check_token_ids(ids: list[int], limits: Limits) -> None:
    """Ids a tokenizer produced must fit the embedding too (a tokenizer larger than the model)."""
    vocab = limits.vocab_size
    if vocab and ids and max(ids) >= vocab:
        refuse(
            "generate", f"the prompt tokenizes to id {max(ids)}, outside the vocabulary ({vocab})"
        )
