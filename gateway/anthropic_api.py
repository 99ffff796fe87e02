"""Anthropic's Messages API: /v1/messages (SSE from message_start to message_stop) and
/v1/messages/count_tokens, in the shapes the official `anthropic` package parses."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import fields as f
from .context import Api, Gateway
from .errors import ApiError, ErrorKind, invalid
from .generation import Finish, GenerationRequest, Stream

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
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.TOO_LARGE: "request_too_large",
    ErrorKind.OVERLOADED: "rate_limit_error",
    ErrorKind.UNAVAILABLE: "overloaded_error",
    ErrorKind.INTERNAL: "api_error",
    ErrorKind.CLIENT_CLOSED: "api_error",
}


def error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPE[err.kind], "message": err.message}}


def error_response(err: ApiError) -> Response:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers())


def _blocks_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: content must be a string or a list of blocks")
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise invalid(f"{where}: only text blocks are supported here")
        texts.append(f.required(block, "text", str, prefix=f"{where}."))
    return "".join(texts)


def _turns(msg: dict, where: str) -> list[dict]:
    """One Anthropic message as chat-template turns (tool_result blocks become tool turns)."""
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role must be 'user' or 'assistant'")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of blocks")
    turns, texts, calls = [], [], []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(f.required(block, "text", str, prefix=f"{at}."))
        elif kind == "tool_use" and role == "assistant":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": block.get("input") or {}},
                }
            )
        elif kind == "tool_result" and role == "user":
            turns.append(
                {
                    "role": "tool",
                    "content": _blocks_text(block.get("content") or "", at),
                    "tool_call_id": block.get("tool_use_id"),
                }
            )
        else:
            raise invalid(f"{at}: block type {kind!r} is not supported")
    if texts or calls or not turns:
        turn = {"role": role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


def _messages(body: dict) -> tuple[dict, ...]:
    raw = f.get(body, "messages", list)
    if not raw:
        raise invalid("'messages' must be a non-empty array")
    turns = []
    system = body.get("system")
    if system:
        turns.append({"role": "system", "content": _blocks_text(system, "system")})
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise invalid(f"messages[{i}] must be an object")
        turns.extend(_turns(msg, f"messages[{i}]"))
    return tuple(turns)


def _tools(body: dict) -> tuple[dict, ...] | None:
    tools = f.get(body, "tools", list)
    choice = f.get(body, "tool_choice", dict) or {}
    if not tools or choice.get("type") == "none":
        return None
    # The chat templates expect OpenAI-style function specs.
    return tuple(
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {},
            },
        }
        for t in tools
        if isinstance(t, dict)
    )


def parse_messages(body: dict) -> GenerationRequest:
    f.required(body, "model", str)
    max_tokens = f.at_least(f.required(body, "max_tokens", int), 1, "max_tokens")
    temperature = f.get(body, "temperature", float)
    if temperature is not None and not 0 <= temperature <= 1:
        raise invalid("'temperature' must be in [0, 1]")
    top_p = f.get(body, "top_p", float)
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("'top_p' must be in (0, 1]")
    return GenerationRequest(
        messages=_messages(body),
        tools=_tools(body),
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

    def text(self, text: str) -> list[bytes]:
        out = []
        if not self.text_open:
            block = {"type": "text", "text": ""}
            out.append(_block_start(self.index, block))
            self.text_open = True
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

    def close(self) -> list[bytes]:
        if not self.text_open:
            return []
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


async def _sse_body(
    gateway: Gateway, stream: Stream, started: float, message: dict
) -> AsyncIterator[bytes]:
    yield _event("message_start", {"type": "message_start", "message": message})
    blocks = _Blocks()
    for frame in blocks.text(""):  # clients expect a text block to open the content
        yield frame
    yield _event("ping", {"type": "ping"})
    try:
        async for event in gateway.tokens(stream, API, "/v1/messages", started):
            if event.text:
                for frame in blocks.text(event.text):
                    yield frame
            for call in event.tool_calls or ():
                for frame in blocks.tool_call(call):
                    yield frame
    except ApiError as err:
        yield _event("error", error_body(err))
        return
    outcome = stream.outcome
    for frame in blocks.close():
        yield frame
    delta = {"stop_reason": STOP_REASON[outcome.finish], "stop_sequence": outcome.stop_sequence}
    usage = _usage(outcome)
    yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
    yield _event("message_stop", {"type": "message_stop"})


def _usage(outcome) -> dict:
    """Anthropic's split: `input_tokens` are the prompt tokens read, the prefix cache's share
    is `cache_read_input_tokens` (the sum is the whole prompt)."""
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
        "output_tokens": outcome.completion_tokens,
        "cache_read_input_tokens": outcome.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


async def messages(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    started = time.perf_counter()
    body = await f.json_body(request)
    req = parse_messages(body)
    model = (await gateway.model()).get("name")
    stream = await gateway.start(req)
    message = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    if f.get(body, "stream", bool, False):
        return StreamingResponse(
            _sse_body(gateway, stream, started, message),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    result = await gateway.collect(request, stream, API, "/v1/messages", started)
    outcome = stream.outcome
    message.update(
        content=[
            *(
                [{"type": "text", "text": result.text}]
                if result.text or not result.tool_calls
                else []
            ),
            *(_tool_use(call) for call in result.tool_calls),
        ],
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
