"""Reasoning told apart from the answer with the model's own think markers (mlx-lm infers them
from the tokenizer's vocabulary: `<think>`/`</think>` and the other families it knows).

A templated prompt whose last think start comes after its last think end (Qwen3.5/3.6 open the
reasoning in the generation prompt) starts in the reasoning channel. The markers themselves go to
no channel; text that might begin a marker is held back, as for stops and tool calls.

A row held to a grammar splits by the grammar's own rule instead (`held`): the reasoning ends at
the think end marker's tokens, the token ids the grammar waits for (ThinkEnd), never at the same
text spelled by other tokens, and the answer never goes back to reasoning (the grammar holds all
of it, so a `<think>` inside a JSON string is the answer's text). The text the client sees and
the text the grammar holds are then the same.
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


class ThinkEnd:
    """Whether the think end marker's token ids were just sampled (the last of them now)."""

    def __init__(self, tokenizer: Any):
        self.tokens = tuple(getattr(tokenizer, "think_end_tokens", None) or ())
        self._recent: tuple[int, ...] = ()

    def seen(self, token: int) -> bool:
        if not self.tokens:
            return False
        self._recent = (*self._recent, token)[-len(self.tokens) :]
        return self._recent == self.tokens


class ReasoningSplit:
    """Cuts a completion's text deltas into (channel, text) segments at the think markers."""

    def __init__(
        self, tokenizer: Any, active: bool, channel: Channel = Channel.ANSWER, held: bool = False
    ):
        self.active = active and bool(getattr(tokenizer, "has_thinking", False))
        self.channel = channel if self.active else Channel.ANSWER
        if self.active:
            self._marker = {
                Channel.ANSWER: tokenizer.think_start,  # what switches the answer to reasoning
                Channel.REASONING: tokenizer.think_end,
            }
        self._buffer = ""
        self._think_end = ThinkEnd(tokenizer) if held else None  # a grammar's rule (above)

    def feed(self, text: str, token: int | None = None) -> list[Segment]:
        """The segments of the next text delta; `token` is the id it came from (a held split
        switches on ids)."""
        if not self.active:
            return [(Channel.ANSWER, text)] if text else []
        if self._think_end is not None:
            return self._feed_held(text, token)
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

    def _feed_held(self, text: str, token: int | None) -> list[Segment]:
        out: list[Segment] = []
        if self.channel is Channel.ANSWER:
            _append(out, Channel.ANSWER, text)
            return out
        assert self._think_end is not None  # a held split
        self._buffer += text
        marker = self._marker[Channel.REASONING]
        if token is not None and self._think_end.seen(token):
            at = self._buffer.rfind(marker)
            before, after = (
                (self._buffer[:at], self._buffer[at + len(marker) :])
                if at >= 0
                else (self._buffer, "")
            )
            self._buffer = ""
            self.channel = Channel.ANSWER
            _append(out, Channel.REASONING, before)
            _append(out, Channel.ANSWER, after)
            return out
        keep = _partial_suffix(self._buffer, marker)  # it may still end as the marker's tokens
        _append(out, Channel.REASONING, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return out

    def replay(self, text: str, tokens: list[int] | None = None) -> None:
        """Text a resumed stream had sent already (and the ids it came from): it moves the
        channel, nothing is sent again."""
        if self._think_end is not None and self.active:
            if any([self._think_end.seen(t) for t in tokens or ()]):
                self.channel = Channel.ANSWER
        else:
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
