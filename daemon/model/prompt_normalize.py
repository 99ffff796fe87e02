"""Lines that clients vary on every request although they change nothing the model should read,
removed before the chat template renders the prompt, so that the prefix cache still matches.

- Claude Code starts its system prompt with `x-anthropic-billing-header: cc_version=...;
  cc_entrypoint=...; cch=...;`, a line whose hash changes per request (Anthropic's API strips it
  before the model sees it too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# A whole line at the very start of a system message.
_VARYING_SYSTEM_LINES = (re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)"),)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """`messages` with the known per-request lines taken out of system turns (the rest as is)."""
    out: list[Mapping[str, Any]] = []
    for turn in messages:
        content = turn.get("content")
        if turn.get("role") == "system" and isinstance(content, str):
            for pattern in _VARYING_SYSTEM_LINES:
                if pattern.match(content.lstrip()):
                    content = pattern.sub("", content.lstrip(), count=1)
            turn = {**turn, "content": content}
        out.append(turn)
    return out
