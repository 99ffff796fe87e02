"""A request's token budget, checked before it starts: the prompt (counted by the daemon with the
model's own template and tokenizer) against the context, and `max_tokens` against the daemon's
limit, so each API answers in its own words instead of the daemon capping the request silently.

Every generation asks the daemon to check as it tokenizes (`strict_max_tokens`): a refusal comes
back with its numbers (`budget_error`), so no request waits for a `count_tokens` first. Counting
first (`check_budget`) is left to what needs the count before it can start: a stream whose model
is still loading, Ollama's `num_predict: -1` (the rest of the context)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from moed.client import ClientError
from moed.protocol import ErrorCode, GenerateRequest, Limits, MessageType
from moed.protocol.errors import BudgetExceeded
from moed.protocol.validation import check_context, check_max_tokens

from .errors import ApiError, ErrorKind, from_client_error
from .wire_limits import check_frame


class Overrun(str, enum.Enum):
    """Which bound a request crosses (named as the daemon's error codes for it)."""

    PROMPT = "prompt_too_long"  # the prompt alone fills the context (or the daemon's prompt cap)
    CONTEXT = "context_exceeded"  # prompt + max_tokens is over the context
    MAX_TOKENS = "max_tokens_too_large"  # max_tokens is over the daemon's max_tokens limit


class BudgetError(ApiError):
    """A 400 carrying the numbers, so every API can phrase it the way its own clients parse."""

    def __init__(self, overrun: Overrun, prompt_tokens: int, max_tokens: int | None, limit: int):
        self.overrun = overrun
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit
        if overrun is Overrun.PROMPT:
            message = f"prompt is too long: {prompt_tokens} tokens > {limit} maximum"
        elif overrun is Overrun.CONTEXT:
            message = (
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) is over the "
                f"model's context of {limit} tokens"
            )
        else:
            message = f"max_tokens {max_tokens} is over this daemon's limit of {limit}"
        too_many = overrun is Overrun.MAX_TOKENS
        param = "max_tokens" if too_many else "messages"
        code = "max_tokens_too_large" if too_many else "context_length_exceeded"
        super().__init__(ErrorKind.INVALID_REQUEST, message, param=param, code=code)


def budget_error(exc: ClientError) -> BudgetError | None:
    """The daemon's refusal of a prompt or max_tokens over a limit (`strict_max_tokens`), when it
    carries the numbers, as the BudgetError each API phrases in its own words."""
    budget = getattr(exc, "budget", None)
    code = getattr(exc, "code", None)
    if not isinstance(budget, dict) or not isinstance(code, ErrorCode):
        return None
    try:
        overrun = Overrun(code.value)
        return BudgetError(
            overrun, int(budget["prompt_tokens"]), budget.get("max_tokens"), int(budget["limit"])
        )
    except (ValueError, KeyError, TypeError):
        return None


def _limits(described: dict) -> Limits:
    """The daemon's limits from its welcome's description of them."""
    names = {f.name for f in dataclasses.fields(Limits)}
    return Limits(**{k: v for k, v in described.items() if k in names and v is not None})


@dataclass(frozen=True)
class Budget:
    prompt_tokens: int
    context_tokens: int | None  # None: the checkpoint does not say


async def daemon_limits(client) -> dict:
    """The daemon's welcome.limits (context_tokens, max_prompt_tokens, max_tokens, ...)."""
    try:
        welcome = await client.connect()
    except ClientError as exc:
        raise from_client_error(exc) from None
    return welcome.get("limits") or {}


async def count_prompt(client, req: GenerateRequest) -> int:
    """The prompt's tokens as the daemon will read them (chat template applied)."""
    if req.prompt_ids is not None:
        return len(req.prompt_ids)
    # What the generate's template will see (tools unless tool_choice is none, its kwargs): the
    # same ids, which the daemon then tokenizes once for both (model/prompt_ids_memo.py).
    fields = {
        "prompt": req.prompt,
        "messages": list(req.messages) if req.messages is not None else None,
        "tools": list(req.template_tools) if req.template_tools else None,
        "raw": req.raw or None,
        "chat_template_kwargs": dict(req.chat_template_kwargs)
        if req.chat_template_kwargs
        else None,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    # The first frame of the request to reach the daemon: the edge's size and depth checks first
    # (a 413 or 400 in the API's shape), never a frame the daemon refuses as malformed.
    await check_frame(client, MessageType.COUNT_TOKENS, fields)
    try:
        counted = await client.count_tokens(**fields)
    except ClientError as exc:
        raise from_client_error(exc) from None
    return int(counted["tokens"])


async def check_budget(client, req: GenerateRequest) -> Budget:
    """Count the prompt and check it, and `max_tokens` when given, against the daemon's limits
    by the daemon's own rules (protocol/validation.py, as a `strict_max_tokens` generate is
    checked); a request over any of them is a BudgetError, never a generation cut short without
    a word."""
    limits = _limits(await daemon_limits(client))
    prompt = await count_prompt(client, req)
    try:
        if prompt:  # an empty prompt is the generate's own `invalid_request`
            check_context(prompt, 0, 1, limits)  # no resumed tokens: max_tokens plays no part
        check_max_tokens(req.max_tokens, prompt, limits)
    except BudgetExceeded as exc:
        raise BudgetError(Overrun(exc.code.value), prompt, exc.max_tokens, exc.limit) from None
    return Budget(prompt, limits.context_tokens)
