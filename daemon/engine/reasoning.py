"""Reasoning told apart from the answer with the model's own think markers (mlx-lm infers them
from the tokenizer's vocabulary: `<think>`/`</think>` and the other families it knows).

A templated prompt whose last think start comes after its last think end (Qwen3.5/3.6 open the
reasoning in the generation prompt) starts in the reasoning channel. The markers themselves go to
no channel; text that might begin a marker is held back, as for stops and tool calls.
"""

from __future__ import annotations

from typing import Any

from moed.protocol import Channel

Segment = tuple[Channel, str]


def initial_channel(tokenizer: Any, prompt_ids: list[int]) -> Channel:
    """The channel the first generated token is in: reasoning when the prompt left one open."""
    if not getattr(tokenizer, "has_thinking", False):
        return Channel.ANSWER
    start = tokenizer.rfind_think_start(prompt_ids)
    end = tokenizer.rfind_think_end(prompt_ids)
    return Channel.REASONING if start >= 0 and start > end else Channel.ANSWER


class ReasoningSplit:
    """Cuts a completion's text deltas into (channel, text) segments at the think markers."""

    def __init__(self, tokenizer: Any, active: bool, channel: Channel = Channel.ANSWER):
        self.active = active and bool(getattr(tokenizer, "has_thinking", False))
        self.channel = channel if self.active else Channel.ANSWER
        if self.active:
            self._marker = {
                Channel.ANSWER: tokenizer.think_start,  # what switches the answer to reasoning
                Channel.REASONING: tokenizer.think_end,
            }
        self._buffer = ""

    def feed(self, text: str) -> list[Segment]:
        if not self.active:
            return [(Channel.ANSWER, text)] if text else []
        self._buffer += text
        out: list[Segment] = []
        while True:
            marker = self._marker[self.channel]
            at = self._buffer.find(marker)
            if at < 0:
                keep = _partial_suffix(self._buffer, marker)
                _append(out, self.channel, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            _append(out, self.channel, self._buffer[:at])
            self._buffer = self._buffer[at + len(marker) :]
            self.channel = (
                Channel.ANSWER if self.channel is Channel.REASONING else Channel.REASONING
            )

    def replay(self, text: str) -> None:
        """Text a resumed stream had sent already: it moves the channel, nothing is sent again."""
        self.feed(text)
        self._buffer = ""

    def flush(self) -> list[Segment]:
        """At the end: text held back as a possible marker is its channel's text after all."""
        held, self._buffer = self._buffer, ""
        return [(self.channel, held)] if held else []


def _append(out: list[Segment], channel: Channel, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] is channel:
        out[-1] = (channel, out[-1][1] + text)
    else:
        out.append((channel, text))


def _partial_suffix(buffer: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(buffer)), 0, -1):
        if buffer.endswith(marker[:n]):
            return n
    return 0
