"""Anthropic's Messages API: /v1/messages (SSE from message_start to message_stop) and
/v1/messages/count_tokens, in the shapes the official `anthropic` package parses."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moed.protocol import GenerateRequest

from . import agent_fields as agent
from . import fields as f
from .anthropic_budget import budget_message
from .context import REASONING, Api, Collected, Gateway, PartKind
from .errors import ApiError, ErrorKind, invalid
from .generation import KEEPALIVE_S, Finish, Outcome, Stream, Waiting
from .token_budget import BudgetError, daemon_limits

API = Api.ANTHROPIC
STOP_REASON = {
    Finish.END: "end_turn",
    Finish.STOP_SEQUENCE: "stop_sequence",
    Finish.LENGTH: "max_tokens",
    Finish.CANCELLED: "end_turn",
    Finish.TOOL_CALLS: "tool_use",
}
_ERROR_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.FORBIDDEN: "permission_error",
    ErrorKind.TIMEOUT: "timeout_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.TOO_LARGE: "request_too_large",
    ErrorKind.OVERLOADED: "rate_limit_error",
    ErrorKind.UNAVAILABLE: "overloaded_error",
    ErrorKind.INTERNAL: "api_error",
    ErrorKind.CLIENT_CLOSED: "api_error",
}


def error_body(err: ApiError) -> dict:
    message = budget_message(err) if isinstance(err, BudgetError) else err.message
    return {"type": "error", "error": {"type": _ERROR_TYPE[err.kind], "message": message}}


def error_response(err: ApiError) -> Response:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers())


def _blocks_text(content, where: str) -> str:
    """A string, or text blocks joined (their cache_control is accepted: the daemon's prefix
    cache reuses every shared prefix on its own)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: content must be a string or a list of blocks")
    texts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise invalid(f"{where}[{i}]: block type {kind!r} is not supported here (text only)")
        texts.append(f.required(block, "text", str, prefix=f"{where}[{i}]."))
    return "".join(texts)


def _tool_call(block: dict) -> dict:
    return {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": block.get("name"), "arguments": block.get("input") or {}},
    }


def _turns(msg: dict, where: str) -> list[dict]:
    """One Anthropic message as chat-template turns (tool_result blocks become tool turns)."""
    role = msg.get("role")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks")
    turns, texts, calls, thoughts = [], [], [], []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(f.required(block, "text", str, prefix=f"{at}."))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            thoughts.append(f.get(block, "thinking", str, "", prefix=f"{at}."))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block))
        elif kind == "thinking" and role == "assistant":
            # Earlier reasoning, under the name chat templates read it by (Qwen3, DeepSeek).
            thoughts.append(f.get(block, "thinking", str, "", prefix=f"{at}."))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by another server: nothing a local model can read
        elif kind == "tool_result" and role == "user":
            turns.append(
                {
                    "role": "tool",
                    "content": _blocks_text(block.get("content") or "", f"{at}.content"),
                    "tool_call_id": block.get("tool_use_id"),
                }
            )
        else:
            raise invalid(f"{at}: block type {kind!r} is not supported in a {role} message")
    if texts or calls or not turns:
        turn = {"role": role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        if any(thoughts):  # the template renders reasoning carried back from its own field
            turn["reasoning_content"] = "".join(thoughts)
        turns.append(turn)
    return turns


def _messages(body: dict) -> tuple[dict, ...]:
    """The conversation as chat turns. System text, from `system` and from `role: system`
    entries inside `messages` (Claude Code sends both), is folded in order into one system turn
    first, where every chat template expects it."""
    raw = f.get(body, "messages", list)
    if not raw:
        raise invalid("'messages' must be a non-empty array")
    given = body.get("system") or []
    if not isinstance(given, str | list):
        raise invalid("'system' must be a string or a list of text blocks")
    # Each system block is a paragraph of its own, as a system entry is.
    blocks = [given] if isinstance(given, str) else [[b] for b in given]
    system = [_blocks_text(b, "system") for b in blocks]
    turns = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(f"{where} must be an object")
        role = msg.get("role")
        if role == "system":
            system.append(_blocks_text(msg.get("content") or "", f"{where}.content"))
        elif role in ("user", "assistant"):
            turns.extend(_turns(msg, where))
        else:
            raise invalid(f"{where}.role must be 'user', 'assistant' or 'system'")
    if not turns:
        raise invalid("'messages' must hold at least one user or assistant message")
    head = [{"role": "system", "content": "\n\n".join(t for t in system if t)}] if system else []
    return (*head, *turns)


def _tools(body: dict) -> tuple[dict, ...]:
    tools = f.get(body, "tools", list)
    choice = f.get(body, "tool_choice", dict) or {}
    if not tools or choice.get("type") == "none":
        return ()
    # The chat templates expect OpenAI-style function specs (the daemon's edge checks the rest).
    specs = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid(f"'tools.{i}' must be an object", f"tools.{i}")
        where = f"tools.{i}."
        function = {
            "name": f.required(tool, "name", str, prefix=where),
            "description": f.get(tool, "description", str, "", prefix=where),
            "parameters": f.get(tool, "input_schema", dict, prefix=where) or {},
        }
        specs.append({"type": "function", "function": function})
    return tuple(specs)


THINKING_TYPES = ("enabled", "disabled", "adaptive")


def _check_accepted(body: dict) -> None:
    """Fields Claude Code and the SDKs send that change nothing here are checked for shape and
    accepted (metadata, context_management, service_tier, output_config's effort); what would
    change the answer and cannot be honoured is refused, never ignored."""
    for name in ("metadata", "context_management", "output_config", "container"):
        f.get(body, name, dict)
    f.get(body, "service_tier", str)
    thinking = f.get(body, "thinking", dict)
    if thinking is not None and thinking.get("type") not in THINKING_TYPES:
        raise invalid(f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}")
    if (f.get(body, "output_config", dict) or {}).get("format") is not None:
        raise invalid("'output_config.format' (structured output) is not supported here")
    if f.get(body, "top_k", int) is not None:
        raise invalid("'top_k' is not supported here: use temperature and top_p")


def parse_messages(body: dict) -> GenerateRequest:
    f.required(body, "model", str)
    max_tokens = f.at_least(f.required(body, "max_tokens", int), 1, "max_tokens")
    _check_accepted(body)
    temperature = f.get(body, "temperature", float)
    if temperature is not None and not 0 <= temperature <= 1:
        raise invalid("'temperature' must be in [0, 1]")
    top_p = f.get(body, "top_p", float)
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("'top_p' must be in (0, 1]")
    tool_choice, parallel = agent.anthropic_tool_choice(body)
    return GenerateRequest(
        messages=_messages(body),
        tools=_tools(body),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=agent.anthropic_thinking(body),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=f.stop_list(f.get(body, "stop_sequences", list), "stop_sequences"),
        model=f.get(body, "model", str),
    )


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class _Blocks:
    """Content blocks streamed in order: text goes to an open text block; a tool call closes it
    and is sent as a whole tool_use block; text after that opens a new text block."""

    def __init__(self) -> None:
        self.index = 0
        self.text_open = False
        self.thinking_open = False
        self.opened = False  # any block so far

    def thinking(self, text: str) -> list[bytes]:
        """Reasoning goes to an open thinking block (a text block open before is closed)."""
        out = []
        if not self.thinking_open:
            out += self.close()
            out.append(_block_start(self.index, {"type": "thinking", "thinking": ""}))
            self.thinking_open = self.opened = True
        delta = {"type": "thinking_delta", "thinking": text}
        out.append(
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.index, "delta": delta},
            )
        )
        return out

    def text(self, text: str) -> list[bytes]:
        out = self._close_thinking()
        if not self.text_open:
            block = {"type": "text", "text": ""}
            out.append(_block_start(self.index, block))
            self.text_open = self.opened = True
        delta = {"type": "text_delta", "text": text}
        out.append(
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.index, "delta": delta},
            )
        )
        return out

    def tool_call(self, call: dict) -> list[bytes]:
        out = self.close()
        self.opened = True
        block = {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call["arguments"])}
        out += [
            _block_start(self.index, block),
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.index, "delta": delta},
            ),
            _event("content_block_stop", {"type": "content_block_stop", "index": self.index}),
        ]
        self.index += 1
        return out

    def _close_thinking(self) -> list[bytes]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        self.index += 1
        # A local model signs nothing: an empty signature, which clients send back as it is.
        delta = {"type": "signature_delta", "signature": ""}
        return [
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.index - 1, "delta": delta},
            ),
            _event("content_block_stop", {"type": "content_block_stop", "index": self.index - 1}),
        ]

    def close(self) -> list[bytes]:
        if not self.text_open:
            return self._close_thinking()
        self.text_open = False
        self.index += 1
        return [
            _event("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})
        ]


def _block_start(index: int, block: dict) -> bytes:
    return _event(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": call["id"], "name": call["name"], "input": call["arguments"]}


def _content(result: Collected) -> list[dict]:
    """The content blocks in the order the model wrote them (a text after a call comes after
    its tool_use block); a turn with neither text nor calls has one empty text block."""
    blocks = []
    for kind, value in result.parts:
        if kind is PartKind.REASONING:
            blocks.append({"type": "thinking", "thinking": value, "signature": ""})
        elif kind is PartKind.TEXT:
            blocks.append({"type": "text", "text": value})
        else:
            blocks.append(_tool_use(value))
    if not any(b["type"] in ("text", "tool_use") for b in blocks):
        blocks.append({"type": "text", "text": ""})
    return blocks


async def _sse_body(
    gateway: Gateway, stream: Stream, started: float, message: dict
) -> AsyncIterator[bytes]:
    yield _event("message_start", {"type": "message_start", "message": message})
    blocks = _Blocks()
    yield _event("ping", {"type": "ping"})
    try:
        async for event in gateway.tokens(stream, API, "/v1/messages", started, KEEPALIVE_S):
            if event is Waiting.WAITING:  # Anthropic's own keep-alive event
                yield _event("ping", {"type": "ping"})
                continue
            if event.channel == REASONING:
                for frame in blocks.thinking(event.text) if event.text else ():
                    yield frame
            elif event.text:
                for frame in blocks.text(event.text):
                    yield frame
            for call in event.tool_calls or ():
                for frame in blocks.tool_call(call):
                    yield frame
    except ApiError as err:
        yield _event("error", error_body(err))
        return
    outcome = stream.ended()
    # A turn with no content still has a (empty) text block, as clients expect.
    for frame in blocks.close() if blocks.opened else blocks.text("") + blocks.close():
        yield frame
    delta = {"stop_reason": STOP_REASON[outcome.finish], "stop_sequence": outcome.stop_sequence}
    yield _event(
        "message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(outcome)}
    )
    yield _event("message_stop", {"type": "message_stop"})


def _usage(outcome: Outcome | None, input_tokens: int = 0) -> dict:
    """Anthropic's usage: `input_tokens` is the whole prompt (as message_start announced it, before
    the prefix cache was asked), `cache_read_input_tokens` the part the prefix cache held."""
    cached = outcome.cached_tokens if outcome else 0
    return {
        "input_tokens": outcome.prompt_tokens if outcome else input_tokens,
        "output_tokens": outcome.completion_tokens if outcome else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


async def messages(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    started = time.perf_counter()
    body = await f.json_body(request)
    req = parse_messages(body)
    model = (await gateway.model()).get("name")
    # message_start reports the input tokens (the stream's first event says them), and an
    # over-long prompt is answered in the words Claude Code reads (a BudgetError from start).
    try:
        stream = await gateway.start(req, API, request)
    except BudgetError as err:  # said with the model's name and, for Claude Code, its context
        context = (await daemon_limits(gateway.client)).get("context_tokens")
        raise ApiError(err.kind, budget_message(err, model, context)) from None
    message: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(None, stream.prompt_tokens),
    }
    if f.get(body, "stream", bool, False):
        return StreamingResponse(
            _sse_body(gateway, stream, started, message),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    result = await gateway.collect(request, stream, API, "/v1/messages", started)
    outcome = stream.ended()
    message.update(
        content=_content(result),
        stop_reason=STOP_REASON[outcome.finish],
        stop_sequence=outcome.stop_sequence,
        usage=_usage(outcome),
    )
    return JSONResponse(message)


async def count_tokens(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    body = await f.json_body(request)
    f.required(body, "model", str)
    tools = _tools(body)
    counted = await gateway.call(
        "count_tokens", messages=list(_messages(body)), tools=list(tools) if tools else None
    )
    return JSONResponse({"input_tokens": counted["tokens"]})


ROUTES = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
