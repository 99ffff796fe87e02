"""A request's prompt as token ids: raw text, token ids, or chat messages through the model's own
chat template (with tools, when the template takes them), tokenized as `mlx_lm.generate` does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moed.daemon.model.prefix_encode import PrefixEncoder
from moed.daemon.model.prompt_ids_memo import PromptIdsMemo
from moed.daemon.model.prompt_normalize import normalize_messages
from moed.protocol import ErrorCode, GenerateRequest, ProtocolError

# A gateway counts a prompt right before it generates it: the second asks the memo.
PROMPT_IDS = PromptIdsMemo()
# An agent's next turn re-sends the last one's text: only its new part is tokenized.
PREFIX_ENCODER = PrefixEncoder()


def prompt_token_ids(tokenizer: Any, req: GenerateRequest) -> list[int]:
    """The prompt of a generate / count_tokens request as token ids."""
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    return PROMPT_IDS.ids(tokenizer, req, lambda: _encode_prompt(tokenizer, req))


def _encode_prompt(tokenizer: Any, req: GenerateRequest) -> list[int]:
    if req.messages is not None:
        return _encode_templated(
            tokenizer,
            render_messages(
                tokenizer, list(req.messages), req.template_tools, req.chat_template_kwargs
            ),
        )
    prompt = req.prompt or ""
    if not req.raw and getattr(tokenizer, "has_chat_template", False):
        # One user turn: the same ids as `messages: [{role: user, content: prompt}]`.
        return _encode_templated(
            tokenizer,
            render_messages(
                tokenizer,
                [{"role": "user", "content": prompt}],
                None,
                req.chat_template_kwargs,
            ),
        )
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not prompt.startswith(bos)
    ids = PREFIX_ENCODER.encode(tokenizer, prompt, add_special_tokens=add_special)
    if not ids:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "the prompt tokenizes to nothing")
    return ids


def render_messages(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The chat template applied to `messages`; a last assistant turn is continued, not closed
    (an assistant prefill), otherwise the assistant's turn is opened. `template_kwargs` go to
    the template as variables (`enable_thinking`, ...)."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            "this model has no chat template: send 'prompt' with 'raw' instead of 'messages'",
        )
    prefill = messages[-1].get("role") == "assistant"
    messages = normalize_messages(messages)  # per-request lines out: cached prefixes still match
    try:
        text: str = tokenizer.apply_chat_template(  # tokenize=False: the text
            messages,
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
            **(template_kwargs or {}),
        )
        return text
    except Exception as exc:  # the template's own checks (roles must alternate, ...) raise
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, f"the chat template refused the messages: {exc}"
        ) from None


def _encode_templated(tokenizer: Any, text: str) -> list[int]:
    # The template wrote the special tokens already (as mlx_lm.generate does for chat prompts).
    return PREFIX_ENCODER.encode(tokenizer, text)
