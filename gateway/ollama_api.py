"""Ollama's API: /api/generate and /api/chat (NDJSON streams, on by default), /api/tags, /api/ps,
/api/version and /api/show, in the shapes the official `ollama` package parses."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from moed.protocol import GenerateRequest
from moed.protocol.units import KeepAliveDuration

from . import agent_fields as agent
from . import fields as f
from .config import moed_version
from .context import REASONING, Api, Gateway
from .errors import ApiError, ErrorKind, invalid
from .generation import Finish, Outcome, Stream
from .token_budget import daemon_limits

API = Api.OLLAMA
TAG = ":latest"
FINISH = {
    Finish.TOOL_CALLS: "stop",
    Finish.END: "stop",
    Finish.STOP_SEQUENCE: "stop",
    Finish.LENGTH: "length",
    Finish.CANCELLED: "stop",
}
_ROLES = ("system", "user", "assistant", "tool")


def error_response(err: ApiError) -> Response:
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers())


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _model_name(body: dict) -> str | None:
    """Ollama names carry a tag (`demo_model:latest`); the daemon knows the bare name."""
    name = f.get(body, "model", str) or f.get(body, "name", str)
    return name[: -len(TAG)] if name and name.endswith(TAG) else name


def _options(body: dict) -> dict:
    options = f.get(body, "options", dict) or {}
    p = "options."
    num_predict = f.get(options, "num_predict", int, prefix=p)
    top_p = f.get(options, "top_p", float, prefix=p)
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("'options.top_p' must be in (0, 1]")
    return {
        # None, -1 (forever) and -2 (fill the context): to the end of the context (open-ended).
        "max_tokens": num_predict if num_predict and num_predict > 0 else None,
        "temperature": f.at_least(f.get(options, "temperature", float, prefix=p), 0, "temperature"),
        "top_p": top_p,
        "seed": f.get(options, "seed", int, prefix=p),
        "stop": f.stop_list(options.get("stop"), "options.stop"),
    }


def _keep_alive(body: dict) -> KeepAliveDuration | None:
    """Ollama's keep_alive (seconds, or a duration like "5m"), refused as the daemon refuses it."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if not isinstance(value, int | float | str) or isinstance(value, bool):
        raise invalid("'keep_alive' must be a number of seconds or a duration such as \"5m\"")
    try:
        return KeepAliveDuration(value)
    except ValueError as exc:
        raise invalid(f"generate: field 'keep_alive': {exc}") from None


def _logprobs(body: dict) -> int | None:
    if not f.get(body, "logprobs", bool):
        return None
    return f.get(body, "top_logprobs", int, 0)


def parse_generate(body: dict) -> GenerateRequest:
    prompt = f.get(body, "prompt", str, "")
    if f.get(body, "suffix", str):
        raise invalid("'suffix' (fill-in-the-middle) is not supported")
    raw = f.get(body, "raw", bool, False)
    common = dict(
        model=_model_name(body),
        logprobs=_logprobs(body),
        keep_alive=_keep_alive(body),
        format=agent.ollama_format(body),
        **_options(body),
    )
    if not raw:
        common["chat_template_kwargs"] = agent.ollama_thinking(body)
    if raw:
        return GenerateRequest(prompt=prompt, raw=True, **common)
    system = f.get(body, "system", str)
    turns = ({"role": "system", "content": system},) if system else ()
    return GenerateRequest(messages=(*turns, {"role": "user", "content": prompt}), **common)


def parse_chat(body: dict) -> GenerateRequest:
    raw = f.get(body, "messages", list)
    if not raw:
        raise invalid("'messages' must be a non-empty array")
    messages = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]."
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise invalid(f"messages[{i}] must be an object with a role in {', '.join(_ROLES)}")
        if msg.get("images"):
            raise invalid("images are not supported")
        turn = {"role": msg["role"], "content": f.get(msg, "content", str, "", prefix=where)}
        calls = f.get(msg, "tool_calls", list, prefix=where)
        if calls:
            turn["tool_calls"] = calls
        thinking = f.get(msg, "thinking", str, prefix=where)
        if thinking and msg["role"] == "assistant":  # as the chat templates name it
            turn["reasoning_content"] = thinking
        messages.append(turn)
    tools = f.get(body, "tools", list)
    return GenerateRequest(
        messages=tuple(messages),
        tools=tuple(tools or ()),
        model=_model_name(body),
        logprobs=_logprobs(body),
        keep_alive=_keep_alive(body),
        format=agent.ollama_format(body),
        chat_template_kwargs=agent.ollama_thinking(body),
        **_options(body),
    )


def _final(outcome: Outcome, model: str) -> dict:
    t = outcome.timings
    ns = 1_000_000_000
    total = t.get("total_s") or 0.0
    ttft = t.get("ttft_s") or 0.0
    return {
        "model": model,
        "created_at": _now(),
        "done": True,
        "done_reason": FINISH[outcome.finish],
        "total_duration": int(total * ns),
        "load_duration": 0,
        "prompt_eval_count": outcome.prompt_tokens,
        "prompt_eval_duration": int(max(ttft - (t.get("queued_s") or 0.0), 0.0) * ns),
        "eval_count": outcome.completion_tokens,
        "eval_duration": int(max(total - ttft, 0.0) * ns),
    }


def _logprob_list(entries: list[dict]) -> list[dict]:
    return [
        {
            "token": e.get("token", ""),
            "logprob": e["logprob"],
            "top_logprobs": [
                {"token": t.get("token", ""), "logprob": t["logprob"]} for t in e.get("top", [])
            ],
        }
        for e in entries
    ]


def _line(data: dict) -> bytes:
    return (json.dumps(data, separators=(",", ":")) + "\n").encode()


async def _ndjson(
    gateway: Gateway, stream: Stream, endpoint: str, started: float, piece, model: str, end: dict
) -> AsyncIterator[bytes]:
    ids: list[int] = []
    try:
        async for event in gateway.tokens(stream, API, endpoint, started):
            ids.extend(event.ids)
            if event.channel == REASONING:
                if event.text:
                    part = {"model": model, "created_at": _now(), **piece("", None, event.text)}
                    yield _line({**part, "done": False})
            elif event.text or event.logprobs or event.tool_calls:
                body = piece(event.text, event.tool_calls)
                part = {"model": model, "created_at": _now(), **body, "done": False}
                if event.logprobs:
                    part["logprobs"] = _logprob_list(event.logprobs)
                yield _line(part)
    except ApiError as err:
        yield _line({"error": err.message})
        return
    extra = {"context": ids} if endpoint == "/api/generate" else {}
    yield _line({**_final(stream.ended(), model), **piece("", None), **end, **extra})


async def _run(request: Request, endpoint: str, parse, piece) -> Response:
    gateway: Gateway = request.app.state.gateway
    started = time.perf_counter()
    body = await f.json_body(request)
    req = parse(body)
    model = (req.model or (await gateway.model()).get("name", "")) + TAG
    if not body.get("prompt") and not body.get("messages"):
        # Ollama's empty prompt loads the model; with keep_alive 0 it unloads it.
        unload = req.keep_alive is not None and req.keep_alive.seconds == 0
        action = "unload" if unload else "load"
        await gateway.call("models", action=action, model=req.model)
        return JSONResponse(
            {
                **piece("", None),
                "model": model,
                "created_at": _now(),
                "done": True,
                "done_reason": action,
            }
        )
    stream = await gateway.start(req, API, request)
    if f.get(body, "stream", bool, True):
        return StreamingResponse(
            _ndjson(gateway, stream, endpoint, started, piece, model, {}),
            media_type="application/x-ndjson",
        )
    result = await gateway.collect(request, stream, API, endpoint, started)
    out = {
        **_final(stream.ended(), model),
        **piece(result.text, result.tool_calls, result.reasoning),
    }
    if endpoint == "/api/generate":
        out["context"] = result.ids
    if req.logprobs is not None:
        out["logprobs"] = _logprob_list(result.logprobs)
    return JSONResponse(out)


async def generate(request: Request) -> Response:
    return await _run(request, "/api/generate", parse_generate, _generate_piece)


def _generate_piece(text: str, calls: list[dict] | None, thinking: str = "") -> dict:
    return {"response": text, **({"thinking": thinking} if thinking else {})}


def _chat_piece(text: str, calls: list[dict] | None, thinking: str = "") -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:  # ollama's `think` answer: the reasoning beside the content
        message["thinking"] = thinking
    if calls:  # ollama's shape: arguments stay a map
        message["tool_calls"] = [
            {"function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls
        ]
    return {"message": message}


async def chat(request: Request) -> Response:
    return await _run(request, "/api/chat", parse_chat, _chat_piece)


def _describe(model: dict) -> dict:
    """The served model in Ollama's list/ps/show shape (size and digest from the files on disk)."""
    path = Path(model.get("path") or "")
    files = [p for p in path.glob("*") if p.is_file()] if path.is_dir() else []
    config = path / "config.json"
    digest = hashlib.sha256(
        config.read_bytes() if config.is_file() else str(path).encode()
    ).hexdigest()
    modified = max((p.stat().st_mtime for p in files), default=0.0)
    quant = model.get("quantization") or {}
    name = (model.get("name") or "") + TAG
    return {
        "name": name,
        "model": name,
        "modified_at": dt.datetime.fromtimestamp(modified, dt.UTC).isoformat(),
        "size": sum(p.stat().st_size for p in files),
        "digest": digest,
        "details": {
            "parent_model": "",
            "format": "safetensors",
            "family": model.get("model_type") or "",
            "families": [model.get("model_type") or ""],
            "parameter_size": "",
            "quantization_level": f"Q{quant['bits']}"
            if isinstance(quant, dict) and quant.get("bits")
            else "F",
        },
    }


async def tags(request: Request) -> Response:
    """Every model the daemon serves on request, loaded or not: the started one first."""
    gateway: Gateway = request.app.state.gateway
    others = (await gateway.call("models")).get("servable", [])[1:]
    return JSONResponse(
        {"models": [_describe(await gateway.model())] + list(map(_describe, others))}
    )


async def ps(request: Request) -> Response:
    """The loaded models, as `ollama ps` shows them: none while the daemon's keep-alive has
    released them (state idle); each expires keep_alive_s after it last went idle."""
    gateway: Gateway = request.app.state.gateway
    started = await gateway.model()
    out = []
    for loaded in (await gateway.call("models")).get("loaded", []):
        if loaded.get("state") == "idle":
            continue
        entry = _describe(started if loaded.get("path") == started.get("path") else loaded)
        keep, idle = loaded.get("keep_alive_s"), loaded.get("idle_s")
        if keep is None or keep < 0 or idle is None:  # never, or a request is running
            expires = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)
        else:
            expires = dt.datetime.fromtimestamp(time.time() + max(0.0, keep - idle), dt.UTC)
        entry.update(expires_at=expires.isoformat(), size_vram=loaded.get("memory_bytes") or 0)
        out.append(entry)
    return JSONResponse({"models": out})


async def version(request: Request) -> Response:
    return JSONResponse({"version": moed_version()})


async def show(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    body = await f.json_body(request)
    name = _model_name(body)
    model = await gateway.model()
    if name is not None and name != model.get("name"):
        raise ApiError(ErrorKind.NOT_FOUND, f"model '{name}' not found")
    entry = _describe(model)
    capabilities = ["completion"] + (["tools"] if model.get("tool_calling") else [])
    arch = model.get("model_type") or "moed"
    context = (await daemon_limits(gateway.client)).get("context_tokens")
    capabilities += ["thinking"] if model.get("thinking") else []  # `think` switches it
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": entry["details"],
            "model_info": {
                "general.architecture": model.get("model_type"),
                "general.block_count": model.get("num_layers"),
                "moed.streaming": model.get("streaming"),
                # Where ollama clients (LiteLLM, aider, Open WebUI) read the context window.
                **({f"{arch}.context_length": context} if context is not None else {}),
            },
            "capabilities": capabilities,
            "modified_at": entry["modified_at"],
        }
    )


ROUTES = [
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/version", version, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
]
