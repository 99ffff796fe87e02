"""GET /v1/models and /v1/models/{name}: every model the daemon serves on request (the started
one first, loaded or not) with its context and output limit, in OpenAI's shape, or in
Anthropic's when the request is an Anthropic client's (the anthropic SDK and Claude Code send
`anthropic-version` on every call): `max_input_tokens`, `max_tokens`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import anthropic_api
from .context import Gateway
from .errors import ApiError, ErrorKind
from .token_budget import daemon_limits

ANTHROPIC_HEADER = "anthropic-version"
# Anthropic's models carry a release date; a local checkpoint has none (the API's own fallback).
EPOCH = "1970-01-01T00:00:00Z"


async def _served(gateway: Gateway) -> list[tuple[str, dict]]:
    """Each servable model's name and limits: the started model's from the daemon's welcome,
    the others' context from their config (their output limit is their context)."""
    name = str((await gateway.model()).get("name"))
    limits = await daemon_limits(gateway.client)
    served = [(name, limits)]
    for other in (await gateway.call("models")).get("servable", [])[1:]:
        context = other.get("context_tokens")
        served.append((str(other["name"]), {"context_tokens": context, "max_tokens": context}))
    return served


def _openai_entry(name: str, limits: dict) -> dict:
    """With the context under the names clients look for (OpenRouter and llama-server
    `context_length`, vLLM `max_model_len`, LM Studio `max_context_length`)."""
    context = limits.get("context_tokens")
    entry = {"id": name, "object": "model", "created": 0, "owned_by": "moed"}
    if context is not None:
        entry.update(context_length=context, max_model_len=context, max_context_length=context)
    entry["max_completion_tokens"] = limits.get("max_tokens")
    return entry


def _anthropic_entry(name: str, limits: dict) -> dict:
    """Anthropic's ModelInfo: the largest prompt (`max_prompt_tokens`, within the context) and
    the largest `max_tokens` a request may name."""
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": EPOCH,
        "lifecycle": "active",
        "max_input_tokens": limits.get("max_prompt_tokens") or limits.get("context_tokens"),
        "max_tokens": limits.get("max_tokens"),
    }


async def models(request: Request) -> Response:
    anthropic = ANTHROPIC_HEADER in request.headers
    try:
        served = await _served(request.app.state.gateway)
    except ApiError as err:
        if anthropic:
            return anthropic_api.error_response(err)
        raise
    if anthropic:
        entries = [_anthropic_entry(name, limits) for name, limits in served]
        first, last = served[0][0], served[-1][0]
        return JSONResponse(
            {"data": entries, "has_more": False, "first_id": first, "last_id": last}
        )
    return JSONResponse({"object": "list", "data": [_openai_entry(n, lim) for n, lim in served]})


async def model(request: Request) -> Response:
    anthropic = ANTHROPIC_HEADER in request.headers
    try:
        served = dict(await _served(request.app.state.gateway))
        name = request.path_params["name"]
        if name not in served:
            raise ApiError(ErrorKind.NOT_FOUND, f"model {name!r} not found")
        limits = served[name]
    except ApiError as err:
        if anthropic:
            return anthropic_api.error_response(err)
        raise
    entry = _anthropic_entry(name, limits) if anthropic else _openai_entry(name, limits)
    return JSONResponse(entry)


ROUTES = [
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{name:path}", model, methods=["GET"]),
]
