"""OpenAI's Responses API: POST /v1/responses, the one Codex CLI and the newer OpenAI SDKs speak.
Stateless (no stored responses); a whole response as JSON, or SSE events from response.created to
response.completed (response.incomplete at max_output_tokens) in the shapes the openai package
parses. Errors are OpenAI's (the app renders every /v1/ path with openai_api.error_response)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import fields as f
from .context import REASONING, Api, Gateway
from .errors import ApiError
from .generation import Finish, Outcome, Stream
from .openai_api import SSE_HEADERS, error_body
from .responses_input import parse_response_request

API = Api.OPENAI
ENDPOINT = "/v1/responses"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [_text_part(text)] if status == "completed" or text else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    """The model's reasoning as a Responses reasoning item (its raw text; no summary is made)."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(call: dict) -> dict:
    """The daemon's {id, name, arguments} as a function_call output item (arguments as text)."""
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": call["name"],
        "arguments": json.dumps(call["arguments"]),
        "status": "completed",
    }


def _usage(outcome: Outcome) -> dict:
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }


class _Envelope:
    """The response object around the output: what the request asked, then status and usage."""

    def __init__(self, body: dict, model: str | None):
        self.base = {
            "id": _id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": model,
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,  # stateless: nothing is kept, whatever `store` asked
            "temperature": body.get("temperature"),
            "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "truncation": "disabled",
            "usage": None,
            "metadata": body.get("metadata") or {},
        }

    def finished(self, output: list[dict], outcome: Outcome) -> dict:
        incomplete = outcome.finish is Finish.LENGTH
        return {
            **self.base,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output,
            "usage": _usage(outcome),
        }


def _output(text: str, calls: list[dict], reasoning: str = "") -> list[dict]:
    """Non-streamed output: the reasoning item, one message item with the text, then the calls."""
    items = [_reasoning_item(_id("rs"), reasoning, "completed")] if reasoning else []
    items += [_message_item(_id("msg"), text, "completed")] if text or not calls else []
    return items + [_call_item(c) for c in calls]


class _Events:
    """The SSE events of one streamed response, numbered in order; output items in the order the
    model produced them (text opens a message item, a tool call closes it)."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict] = []
        self.message: dict | None = None  # the open message item
        self.text: list[str] = []
        self.thought: dict | None = None  # the open reasoning item
        self.thinking: list[str] = []

    def event(self, kind: str, **data) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    def reasoning_delta(self, delta: str) -> list[bytes]:
        out = self.close_message()
        index = len(self.output)
        if self.thought is None:
            self.thought = _reasoning_item(_id("rs"), "", "in_progress")
            self.thinking = []
            out.append(
                self.event("response.output_item.added", output_index=index, item=self.thought)
            )
        self.thinking.append(delta)
        where = {"item_id": self.thought["id"], "output_index": index, "content_index": 0}
        out.append(self.event("response.reasoning_text.delta", **where, delta=delta))
        return out

    def close_reasoning(self) -> list[bytes]:
        if self.thought is None:
            return []
        index, text = len(self.output), "".join(self.thinking)
        where = {"item_id": self.thought["id"], "output_index": index, "content_index": 0}
        item = _reasoning_item(self.thought["id"], text, "completed")
        self.thought = None
        self.output.append(item)
        return [
            self.event("response.reasoning_text.done", **where, text=text),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def text_delta(self, delta: str) -> list[bytes]:
        out = self.close_reasoning()
        index = len(self.output)
        if self.message is None:
            self.message = _message_item(_id("msg"), "", "in_progress")
            self.text = []
            out.append(
                self.event("response.output_item.added", output_index=index, item=self.message)
            )
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.message["id"],
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        self.text.append(delta)
        where = {"item_id": self.message["id"], "output_index": index, "content_index": 0}
        out.append(self.event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return out

    def close_message(self) -> list[bytes]:
        if self.message is None:
            return []
        index, text = len(self.output), "".join(self.text)
        where = {"item_id": self.message["id"], "output_index": index, "content_index": 0}
        item = _message_item(self.message["id"], text, "completed")
        self.message = None
        self.output.append(item)
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=_text_part(text)),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def tool_call(self, call: dict) -> list[bytes]:
        out = self.close_reasoning() + self.close_message()
        index, item = len(self.output), _call_item(call)
        where = {"item_id": item["id"], "output_index": index}
        self.output.append(item)
        return [
            *out,
            self.event(
                "response.output_item.added", output_index=index, item={**item, "arguments": ""}
            ),
            self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


async def _sse_body(
    gateway: Gateway, stream: Stream, started: float, envelope: _Envelope
) -> AsyncIterator[bytes]:
    events = _Events()
    yield events.event("response.created", response=envelope.base)
    yield events.event("response.in_progress", response=envelope.base)
    try:
        async for event in gateway.tokens(stream, API, ENDPOINT, started):
            if event.channel == REASONING:
                for frame in events.reasoning_delta(event.text) if event.text else ():
                    yield frame
            elif event.text:
                for frame in events.text_delta(event.text):
                    yield frame
            for call in event.tool_calls or ():
                for frame in events.tool_call(call):
                    yield frame
    except ApiError as err:  # the stream has started: the error travels in it
        error = error_body(err)["error"]
        yield events.event("error", code=error["code"], message=error["message"], param=None)
        failed = {
            **envelope.base,
            "status": "failed",
            "error": {k: error[k] for k in ("code", "message")},
        }
        yield events.event("response.failed", response=failed)
        return
    for frame in events.close_reasoning() + events.close_message():
        yield frame
    final = envelope.finished(events.output, stream.ended())
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield events.event(kind, response=final)


async def create_response(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    started = time.perf_counter()
    body = await f.json_body(request)
    req = parse_response_request(body)
    envelope = _Envelope(body, (await gateway.model()).get("name"))
    # Over the context: OpenAI's 400, not a shorter answer (the daemon checks as it starts it).
    stream = await gateway.start(req, API, request)
    if f.get(body, "stream", bool, False):
        return StreamingResponse(
            _sse_body(gateway, stream, started, envelope),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    result = await gateway.collect(request, stream, API, ENDPOINT, started)
    output = _output(result.text, result.tool_calls, result.reasoning)
    return JSONResponse(envelope.finished(output, stream.ended()))


ROUTES = [Route(ENDPOINT, create_response, methods=["POST"])]
