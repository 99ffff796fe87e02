"""OpenAI's API: /v1/chat/completions, /v1/completions, /v1/models, in the shapes the official
SDK parses (SSE chunks ending with `data: [DONE]`, errors as {"error": {message, type, ...}})."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import fields as f
from .context import Api, Gateway
from .errors import ApiError, ErrorKind, invalid
from .generation import Finish, GenerationRequest, Outcome, Stream

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
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.TOO_LARGE: "invalid_request_error",
    ErrorKind.OVERLOADED: "rate_limit_error",
    ErrorKind.UNAVAILABLE: "service_unavailable",
    ErrorKind.INTERNAL: "server_error",
    ErrorKind.CLIENT_CLOSED: "client_closed",
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def error_body(err: ApiError) -> dict:
    return {
        "error": {
            "message": err.message,
            "type": _ERROR_TYPE[err.kind],
            "param": err.param,
            "code": err.code,
        }
    }


def error_response(err: ApiError) -> Response:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers())


# ---- request parsing ---------------------------------------------------------------------------
def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (other parts are not supported)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"{where}: only text content parts are supported", where)
            texts.append(f.required(part, "text", str, prefix=f"{where}."))
        return "".join(texts)
    raise invalid(f"{where}: content must be a string or a list of text parts", where)


def _tool_calls(calls, where: str) -> list[dict]:
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise invalid(f"{where}[{i}] must have a 'function' object", where)
        arguments = fn.get("arguments") or "{}"
        try:  # chat templates iterate the arguments as a mapping (as mlx_lm.server passes them)
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise invalid(f"{where}[{i}].function.arguments is not valid JSON", where) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": fn.get("name"), "arguments": arguments},
            }
        )
    return out


def chat_messages(raw) -> tuple[dict, ...]:
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty array", "messages")
    out = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid(f"{where} must be an object", where)
        role = msg.get("role")
        if role == "tool":
            out.append(
                {
                    "role": "tool",
                    "content": _text_content(msg.get("content"), where),
                    "tool_call_id": f.get(msg, "tool_call_id", str, prefix=f"{where}."),
                }
            )
            continue
        if role not in _ROLES:
            raise invalid(f"{where}.role must be one of system, user, assistant, tool", where)
        turn = {"role": _ROLES[role], "content": _text_content(msg.get("content"), where)}
        calls = f.get(msg, "tool_calls", list, prefix=f"{where}.")
        if calls and role == "assistant":
            turn["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        out.append(turn)
    return tuple(out)


def _sampling(body: dict) -> dict:
    temperature = f.at_least(f.get(body, "temperature", float), 0, "temperature")
    top_p = f.get(body, "top_p", float)
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("'top_p' must be in (0, 1]", "top_p")
    n = f.get(body, "n", int, 1)
    if n != 1:
        raise invalid("only n=1 is supported", "n")
    return {
        "temperature": temperature,
        "top_p": top_p,
        "seed": f.get(body, "seed", int),
        "stop": f.stop_list(body.get("stop"), "stop", limit=4),
        "model": f.get(body, "model", str),
    }


def parse_chat(body: dict) -> GenerationRequest:
    max_tokens = f.get(body, "max_completion_tokens", int) or f.get(body, "max_tokens", int)
    f.at_least(max_tokens, 1, "max_tokens")
    tools = f.get(body, "tools", list)
    if body.get("tool_choice") == "none":
        tools = None  # the template is told nothing about tools
    logprobs = None
    if f.get(body, "logprobs", bool):
        top = f.get(body, "top_logprobs", int, 0)
        if not 0 <= top <= 20:
            raise invalid("'top_logprobs' must be in 0..20", "top_logprobs")
        logprobs = top
    return GenerationRequest(
        messages=chat_messages(body.get("messages")),
        tools=tuple(tools) if tools else None,
        max_tokens=max_tokens,
        logprobs=logprobs,
        **_sampling(body),
    )


def parse_completion(body: dict) -> GenerationRequest:
    prompt = body.get("prompt")
    prompt_ids = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompt_ids, prompt = tuple(prompt), None
    elif not isinstance(prompt, str) or not prompt:
        raise invalid("'prompt' must be a non-empty string or a list of token ids", "prompt")
    max_tokens = f.at_least(f.get(body, "max_tokens", int), 1, "max_tokens")
    logprobs = f.get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= 5:
        raise invalid("'logprobs' must be in 0..5", "logprobs")
    if f.get(body, "echo", bool):
        raise invalid("'echo' is not supported", "echo")
    return GenerationRequest(
        prompt=prompt,
        prompt_ids=prompt_ids,
        raw=True,  # completions continue the text as given: no chat template
        max_tokens=max_tokens,
        logprobs=logprobs,
        **_sampling(body),
    )


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
    req: GenerationRequest
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
    request: Request, parse: Callable[[dict], GenerationRequest], id_prefix: str, endpoint: str
) -> _Call:
    gateway: Gateway = request.app.state.gateway
    started = time.perf_counter()
    body = await f.json_body(request)
    req = parse(body)
    streaming = f.get(body, "stream", bool, False)
    include_usage = _include_usage(body)
    model = (await gateway.model()).get("name")
    stream = await gateway.start(req)
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
        async for event in call.gateway.tokens(stream, API, call.endpoint, call.started):
            if event.text or event.logprobs or event.tool_calls:
                yield frame(chunk(event.text, event.logprobs, None, event.tool_calls))
    except ApiError as err:  # the stream has started: the error travels in it
        yield sse(error_body(err))
        return
    outcome = stream.outcome
    yield frame(chunk("", None, FINISH[outcome.finish], None))
    if call.include_usage:
        yield sse({**envelope, "choices": [], "usage": _usage(outcome)})
    yield sse("[DONE]")


async def chat_completions(request: Request) -> Response:
    call = await _start(request, parse_chat, "chatcmpl", "/v1/chat/completions")
    req, stream, envelope = call.req, call.stream, call.envelope
    if call.streaming:
        calls_sent = 0

        def chunk(text, logprobs, finish, calls):
            nonlocal calls_sent
            delta = {"content": text} if text or (finish is None and not calls) else {}
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
    outcome = stream.outcome
    choice = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": result.text or (None if result.tool_calls else ""),
            **({"tool_calls": _tool_call_list(result.tool_calls)} if result.tool_calls else {}),
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

        def chunk(text, logprobs, finish, calls):
            lp = _completion_logprobs(logprobs) if logprobs else None
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}

        return call.streaming_response(chunk, None)
    result = await call.collect(request)
    outcome = stream.outcome
    choice = {
        "index": 0,
        "text": result.text,
        "logprobs": _completion_logprobs(result.logprobs) if req.logprobs is not None else None,
        "finish_reason": FINISH[outcome.finish],
    }
    return JSONResponse({**envelope, "choices": [choice], "usage": _usage(outcome)})


async def models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    model = await gateway.model()
    entry = {"id": model.get("name"), "object": "model", "created": 0, "owned_by": "moed"}
    return JSONResponse({"object": "list", "data": [entry]})


async def model(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    served = (await gateway.model()).get("name")
    if request.path_params["name"] != served:
        raise ApiError(ErrorKind.NOT_FOUND, f"model {request.path_params['name']!r} not found")
    return JSONResponse({"id": served, "object": "model", "created": 0, "owned_by": "moed"})


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{name:path}", model, methods=["GET"]),
]
