"""The request side of OpenAI's Responses API (POST /v1/responses): `input` as text or items
(messages, function_call, function_call_output), `instructions` and function tools, turned into
the chat turns the model's template renders. Stateless: nothing is stored between requests."""

from __future__ import annotations

import json

from moed.protocol import GenerateRequest

from . import fields as f
from .agent_fields import responses_controls
from .errors import invalid

_TEXT_PARTS = ("input_text", "output_text", "text")
_SYSTEM_ROLES = ("system", "developer")


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts joined (images are refused: text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of parts", where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            texts.append(f.get(part, "refusal", str, ""))
        elif kind in _TEXT_PARTS:
            texts.append(f.required(part, "text", str, prefix=f"{where}.content[{i}]."))
        else:
            raise invalid(f"{where}.content[{i}]: part type {kind!r} is not supported", where)
    return "".join(texts)


def _arguments(raw, where: str) -> dict:
    # Chat templates iterate the arguments as a mapping, as mlx_lm.server passes them.
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, json.JSONDecodeError):
        raise invalid(f"{where}.arguments is not valid JSON", where) from None
    if not isinstance(value, dict):
        raise invalid(f"{where}.arguments must be a JSON object", where)
    return value


class _Turns:
    """Chat turns built item by item: function calls join the assistant turn before them."""

    def __init__(self) -> None:
        self.system: list[str] = []
        self.turns: list[dict] = []

    def message(self, item: dict, where: str) -> None:
        role = item.get("role")
        text = _text(item.get("content", ""), where)
        if role in _SYSTEM_ROLES:
            # One system turn first, where every chat template expects it (Codex sends
            # developer messages between user turns).
            self.system.append(text)
        elif role in ("user", "assistant"):
            self.turns.append({"role": role, "content": text})
        else:
            raise invalid(f"{where}.role must be user, assistant, system or developer", where)

    def function_call(self, item: dict, where: str) -> None:
        call = {
            "id": f.required(item, "call_id", str, prefix=f"{where}."),
            "type": "function",
            "function": {
                "name": f.required(item, "name", str, prefix=f"{where}."),
                "arguments": _arguments(item.get("arguments"), where),
            },
        }
        last = self.turns[-1] if self.turns else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.turns.append(last)
        last.setdefault("tool_calls", []).append(call)

    def function_call_output(self, item: dict, where: str) -> None:
        output = item.get("output", "")
        self.turns.append(
            {
                "role": "tool",
                "content": output if isinstance(output, str) else _text(output, where),
                "tool_call_id": f.required(item, "call_id", str, prefix=f"{where}."),
            }
        )

    def reasoning(self, item: dict, where: str) -> None:
        # Earlier reasoning, under the name chat templates read it by (Qwen3, DeepSeek).
        parts = item.get("content") or item.get("summary") or []
        text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        if text and self.turns and self.turns[-1]["role"] == "assistant":
            self.turns[-1]["reasoning_content"] = text
        elif text:
            self.turns.append({"role": "assistant", "content": "", "reasoning_content": text})

    def result(self, instructions: str | None) -> tuple[dict, ...]:
        system = [t for t in (instructions, *self.system) if t]
        if not self.turns:
            raise invalid("'input' must hold at least one user or assistant message", "input")
        head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
        return (*head, *self.turns)


def input_messages(body: dict) -> tuple[dict, ...]:
    raw = body.get("input")
    instructions = f.get(body, "instructions", str)
    turns = _Turns()
    if isinstance(raw, str):
        if not raw:
            raise invalid("'input' must not be empty", "input")
        turns.turns.append({"role": "user", "content": raw})
        return turns.result(instructions)
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a non-empty array of items", "input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", where)
        kind = item.get("type", "message")  # an "easy" message item has no type
        if kind == "message":
            turns.message(item, where)
        elif kind == "function_call":
            turns.function_call(item, where)
        elif kind == "function_call_output":
            turns.function_call_output(item, where)
        elif kind == "reasoning":
            turns.reasoning(item, where)
        else:
            raise invalid(f"{where}: item type {kind!r} is not supported", where)
    return turns.result(instructions)


# Tools OpenAI runs on its own servers: the model is not offered them, as nothing here runs them.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "computer_use_preview",
    }
)


def _function_spec(tool: dict, where: str) -> dict:
    spec = {
        "name": f.required(tool, "name", str, prefix=f"{where}."),
        "description": f.get(tool, "description", str, ""),
        "parameters": f.get(tool, "parameters", dict) or {},
    }
    return {"type": "function", "function": spec}


def _tools(body: dict) -> tuple[dict, ...]:
    """Function tools as the chat templates take them (a namespace's functions among them);
    `tool_choice: none` tells the template nothing about tools. A tool the model would call in a
    form nothing here parses (custom grammar tools) is refused."""
    tools = f.get(body, "tools", list) or []
    if not tools or body.get("tool_choice") == "none":
        return ()
    specs = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            specs.append(_function_spec(tool, f"tools[{i}]"))
        elif kind == "namespace":  # Codex groups tools; the functions keep their own names
            for j, inner in enumerate(f.get(tool, "tools", list, prefix=f"tools[{i}].") or []):
                if isinstance(inner, dict) and inner.get("type") == "function":
                    specs.append(_function_spec(inner, f"tools[{i}].tools[{j}]"))
        elif kind not in HOSTED_TOOLS:
            raise invalid(
                f"tools[{i}]: tool type {kind!r} is not supported here (function tools only)",
                "tools",
            )
    return tuple(specs)


def parse_response_request(body: dict) -> GenerateRequest:
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise invalid(
            "this server is stateless and stores no responses: send the whole conversation "
            "in 'input' instead of 'previous_response_id' or 'conversation'",
            "previous_response_id",
        )
    max_tokens = f.at_least(f.get(body, "max_output_tokens", int), 1, "max_output_tokens")
    temperature = f.at_least(f.get(body, "temperature", float), 0, "temperature")
    top_p = f.get(body, "top_p", float)
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("'top_p' must be in (0, 1]", "top_p")
    for name in ("metadata", "stream_options", "prompt_cache_key"):
        f.get(body, name, str if name == "prompt_cache_key" else dict)
    return GenerateRequest(
        messages=input_messages(body),
        tools=_tools(body),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        model=f.get(body, "model", str),
        cache_salt=f.cache_salt(body),
        **responses_controls(body),
    )
