"""Helpers for tests on the agent checkpoint (Qwen3.6-style template: <think> reasoning, XML tool
calls): its stream split by channel, and prompts whose greedy answer leaves the reasoning."""

from __future__ import annotations

from dataclasses import dataclass, field

from fixtures.tokenizer import THINK_END, THINK_START

from moed.client import DoneEvent, TokenEvent

WORDS = "the quick brown fox jumps over lazy dog hello world paris robot story cache".split()


def prompts(n: int) -> list[str]:
    return [f"{WORDS[i % len(WORDS)]} {WORDS[(i * 7) % len(WORDS)]} {i}" for i in range(n)]


@dataclass
class Split:
    """One generation as the daemon streamed it: (channel, text) in order, ids, the end."""

    parts: list[tuple[str, str]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    done: DoneEvent | None = None

    def text(self, channel: str) -> str:
        return "".join(t for c, t in self.parts if c == channel)

    @property
    def both(self) -> bool:
        return bool(self.text("reasoning").strip()) and bool(self.text("answer").strip())


def stream(client, **request) -> Split:
    out = Split()
    for event in client.generate(**request):
        if isinstance(event, TokenEvent):
            out.ids += event.ids
            out.tool_calls += event.tool_calls or ()
            if event.text:
                out.parts.append((event.channel, event.text))
        elif isinstance(event, DoneEvent):
            out.done = event
    return out


def without_markers(text: str) -> str:
    return text.replace(THINK_START, "").replace(THINK_END, "")


def detokenized(tokenizer, ids: list[int]) -> str:
    """The completion's text as the daemon's detokenizer writes it."""
    detok = tokenizer.detokenizer
    for token in ids:
        detok.add_token(token)
    detok.finalize()
    return detok.text


def channels_of(text: str, channel: str = "reasoning") -> list[tuple[str, str]]:
    """The whole text split at the markers that switch the channel (an end marker in the answer,
    or a start marker in the reasoning, is text), as (channel, text) runs."""
    out = []
    while True:
        marker = THINK_END if channel == "reasoning" else THINK_START
        at = text.find(marker)
        if at < 0:
            return out + ([(channel, text)] if text else [])
        if at:
            out.append((channel, text[:at]))
        text = text[at + len(marker) :]
        channel = "answer" if channel == "reasoning" else "reasoning"
