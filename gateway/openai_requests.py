"""OpenAI's request bodies (chat and completions) as the protocol's GenerateRequest: messages,
tool calls carried back, sampling, logprobs, and the agent controls (agent_fields.py)."""

from __future__ import annotations

from typing import Any

from moed.protocol import GenerateRequest

from . import agent_fields as agent
from . import fields as f
from . import json_edge
from .errors import invalid

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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
        # Chat templates iterate the arguments as a mapping (as mlx_lm.server passes them); the
        # string is read with the body's own bounds (depth, surrogates, integer range).
        if isinstance(arguments, str):
            arguments = json_edge.loads(
                arguments.encode(errors="surrogatepass"), f"{where}[{i}].function.arguments"
            )
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
        turn: dict[str, Any] = {
            "role": _ROLES[role],
            "content": _text_content(msg.get("content"), where),
        }
        # Reasoning carried back (either name peers use) goes to the template as it expects.
        thought = f.get(msg, "reasoning_content", str, prefix=f"{where}.") or f.get(
            msg, "reasoning", str, prefix=f"{where}."
        )
        if thought and role == "assistant":
            turn["reasoning_content"] = thought
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


def parse_chat(body: dict) -> GenerateRequest:
    max_tokens = f.get(body, "max_completion_tokens", int) or f.get(body, "max_tokens", int)
    f.at_least(max_tokens, 1, "max_tokens")
    tools = f.get(body, "tools", list)
    if body.get("tool_choice") == "none":
        tools = []  # the template is told nothing about tools
    logprobs = None
    if f.get(body, "logprobs", bool):
        top = f.get(body, "top_logprobs", int, 0)
        if not 0 <= top <= 20:
            raise invalid("'top_logprobs' must be in 0..20", "top_logprobs")
        logprobs = top
    return GenerateRequest(
        messages=chat_messages(body.get("messages")),
        tools=tuple(tools or ()),
        max_tokens=max_tokens,
        logprobs=logprobs,
        format=agent.openai_format(body),
        tool_choice=agent.openai_tool_choice(body),
        parallel_tool_calls=f.get(body, "parallel_tool_calls", bool),
        chat_template_kwargs=agent.openai_thinking(body),
        cache_salt=f.cache_salt(body),
        **_sampling(body),
    )


def parse_completion(body: dict) -> GenerateRequest:
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
    return GenerateRequest(
        prompt=prompt,
        prompt_ids=prompt_ids,
        raw=True,  # completions continue the text as given: no chat template
        max_tokens=max_tokens,
        logprobs=logprobs,
        cache_salt=f.cache_salt(body),
        **_sampling(body),
    )
