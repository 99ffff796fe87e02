"""Each API's controls for reasoning, structured output and tool choice, mapped to the daemon's
`chat_template_kwargs` (`enable_thinking`), `format`, `tool_choice` and `parallel_tool_calls`.
A control the daemon cannot honour is a 400 here or there, never dropped."""

from __future__ import annotations

import enum

from moed.protocol import NamedTool, ResponseFormat
from moed.protocol.constraints import FormatType, ToolChoice

from . import fields as f
from .errors import ApiError, invalid

THINKING_KWARG = "enable_thinking"  # the chat templates' switch (mlx-lm renames it per model)


class ReasoningEffort(str, enum.Enum):
    """OpenAI's `reasoning_effort`: the template has an on/off switch, so effort is on or off."""

    NONE = "none"
    MINIMAL = "minimal"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    XHIGH = "xhigh"


class AnthropicThinking(str, enum.Enum):
    ENABLED = "enabled"
    DISABLED = "disabled"
    ADAPTIVE = "adaptive"  # the model decides: the template's default


def template_kwargs(extra: dict | None, thinking: bool | None) -> dict | None:
    """`chat_template_kwargs` with the thinking switch set when the client chose one."""
    out = dict(extra or {})
    if thinking is not None:
        out[THINKING_KWARG] = thinking
    return out or None


# ---- OpenAI ------------------------------------------------------------------------------------
def openai_thinking(body: dict) -> dict | None:
    kwargs = f.get(body, "chat_template_kwargs", dict)
    effort = f.get(body, "reasoning_effort", str)
    thinking = None
    if effort is not None:
        try:
            thinking = ReasoningEffort(effort) is not ReasoningEffort.NONE
        except ValueError:
            allowed = ", ".join(e.value for e in ReasoningEffort)
            raise invalid(
                f"'reasoning_effort' must be one of {allowed}", "reasoning_effort"
            ) from None
    return template_kwargs(kwargs, thinking)


def openai_format(body: dict) -> ResponseFormat | None:
    fmt = f.get(body, "response_format", dict)
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return ResponseFormat(FormatType.JSON)
    if fmt.get("type") == "json_schema":
        spec = f.get(fmt, "json_schema", dict, prefix="response_format.")
        schema = spec.get("schema") if spec else None
        if not isinstance(schema, dict):
            raise invalid(
                "'response_format.json_schema.schema' must be a JSON schema object",
                "response_format",
            )
        return ResponseFormat(FormatType.JSON_SCHEMA, schema)
    raise invalid(
        "'response_format.type' must be text, json_object or json_schema", "response_format"
    )


def openai_tool_choice(body: dict) -> ToolChoice | NamedTool | None:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if choice in ("none", "auto", "required"):
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return NamedTool(name)
    raise invalid(
        "'tool_choice' must be none, auto, required or {type: function, function: {name}}",
        "tool_choice",
    )


# ---- OpenAI Responses --------------------------------------------------------------------------
def responses_controls(body: dict) -> dict:
    """`reasoning.effort`, `text.format`, `tool_choice` and `parallel_tool_calls` of a Responses
    request as GenerateRequest fields (the chat API's mappings, in the Responses shapes)."""
    effort = (f.get(body, "reasoning", dict) or {}).get("effort")
    thinking = openai_thinking({"reasoning_effort": effort} if effort is not None else {})
    fmt = (f.get(body, "text", dict) or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":  # Responses puts name/schema/strict beside the type
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    try:
        structured = openai_format({"response_format": fmt})
    except ApiError:
        raise invalid(
            "'text.format.type' must be text, json_object or json_schema (with a schema)",
            "text.format",
        ) from None
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":  # {type, name}: flat here
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return {
        "chat_template_kwargs": thinking,
        "format": structured,
        "tool_choice": openai_tool_choice({"tool_choice": choice}),
        "parallel_tool_calls": f.get(body, "parallel_tool_calls", bool),
    }


# ---- Ollama ------------------------------------------------------------------------------------
def ollama_thinking(body: dict) -> dict | None:
    think = body.get("think")
    if think is None:
        return None
    if isinstance(think, str) and think in ("low", "medium", "high"):
        think = True  # effort levels: the template's switch is on or off
    if not isinstance(think, bool):
        raise invalid("'think' must be true, false, or low / medium / high")
    return template_kwargs(None, think)


def ollama_format(body: dict) -> ResponseFormat | None:
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ResponseFormat(FormatType.JSON)
    if isinstance(fmt, dict):
        return ResponseFormat(FormatType.JSON_SCHEMA, fmt)
    raise invalid("'format' must be \"json\" or a JSON schema object")


# ---- Anthropic ---------------------------------------------------------------------------------
def anthropic_thinking(body: dict) -> dict | None:
    thinking = f.get(body, "thinking", dict)
    if thinking is None:
        return None
    try:
        kind = AnthropicThinking(thinking.get("type"))
    except ValueError:
        raise invalid("'thinking.type' must be enabled, disabled or adaptive") from None
    on = {AnthropicThinking.ENABLED: True, AnthropicThinking.DISABLED: False}.get(kind)
    return template_kwargs(None, on)


def anthropic_tool_choice(body: dict) -> tuple[ToolChoice | NamedTool | None, bool | None]:
    """(tool_choice, parallel_tool_calls) from Anthropic's {type: auto|any|tool|none, name,
    disable_parallel_tool_use}."""
    choice = f.get(body, "tool_choice", dict)
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return ToolChoice(kind), parallel
    if kind == "any":
        return ToolChoice.REQUIRED, parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return NamedTool(choice["name"]), parallel
    raise invalid("'tool_choice.type' must be auto, any, tool (with a name) or none")
