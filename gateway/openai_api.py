"""OpenAI's API: /v1/chat/completions, /v1/completions (/v1/models: models_api.py), in the shapes
the official SDK parses (SSE chunks ending with `data: [DONE]`, errors as {"error": {message,
type, ...}})."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moed.protocol import ErrorCode, GenerateRequest

from . import fields as f
from .context import REASONING, Api, Gateway
from .errors import ApiError, ErrorKind
from .generation import KEEPALIVE_S, Finish, Outcome, Stream, Waiting
from .openai_requests import parse_chat, parse_completion
from .token_budget import BudgetError, Overrun

API = Api.OPENAI
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

FINISH = {
    Finish.END: "stop",
    Finish.STOP_SEQUENCE: "stop",
    Finish.LENGTH: "length",
    Finish.CANCELLED: "stop",
    Finish.TOOL_CALLS: "tool_calls",
}
_ERROR_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.FORBIDDEN: "permission_error",
    ErrorKind.TIMEOUT: "timeout",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.TOO_LARGE: "invalid_request_error",
    ErrorKind.OVERLOADED: "rate_limit_error",
    ErrorKind.UNAVAILABLE: "service_unavailable",
    ErrorKind.INTERNAL: "server_error",
    ErrorKind.CLIENT_CLOSED: "client_closed",
}
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def _budget_message(err: BudgetError) -> str:
    """OpenAI's own wording of a request over the context or the completion limit."""
    if err.overrun is Overrun.MAX_TOKENS:
        return (
            f"max_tokens is too large: {err.max_tokens}. This model supports at most "
            f"{err.limit} completion tokens, whereas you provided {err.max_tokens}."
        )
    if err.overrun is Overrun.CONTEXT and err.max_tokens is not None:
        total = err.prompt_tokens + err.max_tokens
        return (
            f"This model's maximum context length is {err.limit} tokens. However, you requested "
            f"{total} tokens ({err.prompt_tokens} in the messages, {err.max_tokens} in the "
            "completion). Please reduce the length of the messages or completion."
        )
    return (
        f"This model's maximum context length is {err.limit} tokens. However, your messages "
        f"resulted in {err.prompt_tokens} tokens. Please reduce the length of the messages."
    )


def error_body(err: ApiError) -> dict:
    message = _budget_message(err) if isinstance(err, BudgetError) else err.message
    # The daemon's own prompt_too_long (a prompt sent without max_tokens) under OpenAI's code.
    code = CONTEXT_LENGTH_EXCEEDED if err.code == ErrorCode.PROMPT_TOO_LONG.value else err.code
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPE[err.kind],
            "param": err.param,
            "code": code,
        }
    }


def error_response(err: ApiError) -> Response:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers())


# ---- request parsing ---------------------------------------------------------------------------
def _include_usage(body: dict) -> bool:
    options = f.get(body, "stream_options", dict) or {}
    return bool(f.get(options, "include_usage", bool, prefix="stream_options."))


# ---- response rendering -------------------------------------------------------------------------
def _usage(outcome: Outcome) -> dict:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def _chat_logprobs(entries: list[dict]) -> dict:
    def one(e: dict) -> dict:
        token = e.get("token", "")
        return {"token": token, "logprob": e["logprob"], "bytes": list(token.encode())}

    return {
        "content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top", [])]} for e in entries]
    }


def _completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    tokens = [e.get("token", "") for e in entries]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {t.get("token", ""): t["logprob"] for t in e.get("top", [])} for e in entries
        ],
        "text_offset": offsets,
    }


def _tool_call_list(calls: list[dict], first_index: int | None = None) -> list[dict]:
    """The daemon's {id, name, arguments} as OpenAI tool calls (arguments as JSON text); streamed
    ones carry their position in the message."""
    out = []
    for i, call in enumerate(calls):
        entry = {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
        }
        if first_index is not None:
            entry["index"] = first_index + i
        out.append(entry)
    return out


_COMPACT = (",", ":")


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=_COMPACT)
    return f"data: {text}\n\n".encode()


class ChunkFrame:
    """`sse({**envelope, "choices": [entry], **usage_null})` with the constant parts encoded once:
    per token only the choice entry is encoded (the same bytes as encoding the whole object)."""

    def __init__(self, envelope: dict, include_usage: bool):
        self._head = "data: " + json.dumps(envelope, separators=_COMPACT)[:-1] + ',"choices":['
        self._tail = ('],"usage":null}' if include_usage else "]}") + "\n\n"

    def __call__(self, entry: dict) -> bytes:
        return (self._head + json.dumps(entry, separators=_COMPACT) + self._tail).encode()


@dataclass
class _Call:
    """A generation the endpoint has started: what both OpenAI endpoints read off the request."""

    gateway: Gateway
    started: float
    req: GenerateRequest
    streaming: bool
    include_usage: bool
    stream: Stream
    endpoint: str
    envelope: dict  # id, created and model of every response object

    async def collect(self, request: Request):
        """The whole generation, for a response that is not streamed."""
        return await self.gateway.collect(request, self.stream, API, self.endpoint, self.started)

    def streaming_response(self, chunk, opening: dict | None) -> StreamingResponse:
        """Server-sent events: `chunk(text, logprobs, finish, tool_calls)` builds each choice."""
        return StreamingResponse(
            _sse_body(self, chunk, opening), media_type="text/event-stream", headers=SSE_HEADERS
        )


async def _start(
    request: Request, parse: Callable[[dict], GenerateRequest], id_prefix: str, endpoint: str
) -> _Call:
    gateway: Gateway = request.app.state.gateway
    started = time.perf_counter()
    body = await f.json_body(request)
    req = parse(body)
    streaming = f.get(body, "stream", bool, False)
    include_usage = _include_usage(body)
    model = (await gateway.model()).get("name")
    # Over the context: OpenAI's 400, not a shorter completion (the daemon checks as it starts).
    stream = await gateway.start(req, API, request)
    envelope = {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": model,
    }
    return _Call(gateway, started, req, streaming, include_usage, stream, endpoint, envelope)


async def _sse_body(
    call: _Call,
    chunk,  # (text, logprobs, finish, tool_calls) -> the chunk's choices entry
    opening: dict | None,
) -> AsyncIterator[bytes]:
    envelope, stream = call.envelope, call.stream
    frame = ChunkFrame(envelope, call.include_usage)
    if opening is not None:
        yield frame(opening)
    try:
        events = call.gateway.tokens(stream, API, call.endpoint, call.started, KEEPALIVE_S)
        async for event in events:
            if event is Waiting.WAITING:  # an SSE comment: every client ignores it
                yield b": keep-alive\n\n"
                continue
            if event.channel == REASONING:
                if event.text:
                    yield frame(chunk(event.text, event.logprobs, None, event.tool_calls, True))
            elif event.text or event.logprobs or event.tool_calls:
                yield frame(chunk(event.text, event.logprobs, None, event.tool_calls))
    except ApiError as err:  # the stream has started: the error travels in it
        yield sse(error_body(err))
        return
    outcome = stream.ended()
    yield frame(chunk("", None, FINISH[outcome.finish], None))
    if call.include_usage:
        yield sse({**envelope, "choices": [], "usage": _usage(outcome)})
    yield sse("[DONE]")


async def chat_completions(request: Request) -> Response:
    call = await _start(request, parse_chat, "chatcmpl", "/v1/chat/completions")
    req, stream, envelope = call.req, call.stream, call.envelope
    if call.streaming:
        calls_sent = 0

        def chunk(text, logprobs, finish, calls, reasoning=False):
            nonlocal calls_sent
            if reasoning:  # both names peers use: llama-server's and mlx_lm.server/vLLM's
                delta = {"reasoning_content": text, "reasoning": text}
            elif text or (finish is None and not calls):
                delta = {"content": text}
            else:
                delta = {}
            if calls:
                delta["tool_calls"] = _tool_call_list(calls, calls_sent)
                calls_sent += len(calls)
            out = {"index": 0, "delta": delta, "finish_reason": finish}
            if req.logprobs is not None:
                out["logprobs"] = _chat_logprobs(logprobs) if logprobs else None
            return out

        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        envelope["object"] = "chat.completion.chunk"
        return call.streaming_response(chunk, opening)
    result = await call.collect(request)
    outcome = stream.ended()
    choice = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": result.text or (None if result.tool_calls else ""),
            **({"tool_calls": _tool_call_list(result.tool_calls)} if result.tool_calls else {}),
            **(
                {"reasoning_content": result.reasoning, "reasoning": result.reasoning}
                if result.reasoning
                else {}
            ),
        },
        "logprobs": _chat_logprobs(result.logprobs) if req.logprobs is not None else None,
        "finish_reason": FINISH[outcome.finish],
    }
    return JSONResponse(
        {**envelope, "object": "chat.completion", "choices": [choice], "usage": _usage(outcome)}
    )


async def completions(request: Request) -> Response:
    call = await _start(request, parse_completion, "cmpl", "/v1/completions")
    req, stream, envelope = call.req, call.stream, call.envelope
    envelope["object"] = "text_completion"
    if call.streaming:

        def chunk(text, logprobs, finish, calls, reasoning=False):
            lp = _completion_logprobs(logprobs) if logprobs else None
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}

        return call.streaming_response(chunk, None)
    result = await call.collect(request)
    outcome = stream.ended()
    choice = {
        "index": 0,
        "text": result.text,
        "logprobs": _completion_logprobs(result.logprobs) if req.logprobs is not None else None,
        "finish_reason": FINISH[outcome.finish],
    }
    return JSONResponse({**envelope, "choices": [choice], "usage": _usage(outcome)})


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
