"""Tool calls in a streamed completion, cut out with the model's own markers and parsed by mlx-lm's
tool parser for that model (the tokenizer wrapper infers both from the chat template); Qwen3.6's
XML format by tool_format.py, which reads each value the way the forced-call grammar writes it.

Text between the start and end markers never reaches the client as text; each finished call goes
out as `{id, name, arguments}`. Text that might begin a start marker is held back, as for stops. A
call the answer's end leaves open is parsed if it can be (a model that ends its turn without the
end marker) and else given back as the text it was; one cut short (max_tokens: `done` says
`length`) is dropped, never sent as text.

A forced call (`forced`: its grammar writes the markers) ends where the grammar ended it, never at
the end marker's spelling inside one of its JSON strings: at the end marker's own token where it
is one token, else (the JSON format) right after the call's JSON object.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from moed.daemon.engine.tool_format import CallFormat, call_format, parse_xml_call

log = logging.getLogger("moed.engine")
_DECODER = json.JSONDecoder()


class ToolCalls:
    def __init__(
        self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None, forced: bool = False
    ):
        self.active = bool(tools) and bool(getattr(tokenizer, "has_tool_calling", False))
        self.tools = list(tools) if tools else None  # mlx-lm's parsers take a list
        self._end_id: int | None = None  # a forced call's end marker, when it is one token
        self._json_body = False  # a forced call in the JSON format: it ends with its object
        if self.active:
            self.start = tokenizer.tool_call_start
            self.end = tokenizer.tool_call_end
            xml = call_format(tokenizer) is CallFormat.QWEN_XML
            self.parse = parse_xml_call if xml else tokenizer.tool_parser
            if forced:
                ids = tokenizer.encode(self.end, add_special_tokens=False)
                self._end_id = ids[0] if len(ids) == 1 else None
                self._json_body = self._end_id is None and not xml
        self.made = 0  # calls sent so far
        self._buffer = ""
        self._inside = False
        self._end_due = False  # the end marker's token came: the call ends at its text

    def feed(self, text: str, token: int | None = None) -> tuple[str, list[dict[str, Any]]]:
        """(text to send now, finished calls) after the next text delta (of `token`)."""
        if not self.active:
            return text, []
        self._buffer += text
        if token is not None and token == self._end_id:
            self._end_due = True
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._inside:
                at = self._call_end()
                if at < 0:
                    return "".join(out), calls
                calls.extend(self._parsed(self._buffer[:at]))
                self._buffer = self._buffer[at + len(self.end) :]
                self._inside = self._end_due = False
                continue
            at = self._buffer.find(self.start)
            if at < 0:
                keep = _partial_suffix(self._buffer, self.start)
                out.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return "".join(out), calls
            out.append(self._buffer[:at])
            self._buffer = self._buffer[at + len(self.start) :]
            self._inside = True

    def _call_end(self) -> int:
        """Where the open call's end marker starts in the buffer; -1 while it has not come."""
        if self._end_id is not None:
            return self._buffer.rfind(self.end) if self._end_due else -1
        if self._json_body:
            body = self._buffer.lstrip()
            try:
                _, end = _DECODER.raw_decode(body)
            except ValueError:
                return -1
            at = len(self._buffer) - len(body) + end
            return at if self._buffer.startswith(self.end, at) else -1
        return self._buffer.find(self.end)

    def flush(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """At the end: an unterminated call is parsed if it can be, else given back as text;
        unless the answer was `cut` short: then it is dropped, as is text held back as the start
        of a marker."""
        held, self._buffer = self._buffer, ""
        if not self._inside:
            return ("" if cut else held), []
        self._inside = False
        if cut:
            log.info("a tool call cut short at the answer's end was dropped: %.200r", held)
            return "", []
        calls = self._parsed(held)
        return ("", calls) if calls else (self.start + held, [])

    def _parsed(self, text: str) -> list[dict[str, Any]]:
        try:
            parsed = self.parse(text, self.tools)
        except Exception as exc:  # a parser's own error on the model's text: the call is dropped
            log.warning("could not parse a tool call (%s): %.200r", exc.__class__.__name__, text)
            return []
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                log.warning("a tool call without a name was dropped: %.200r", text)
                continue
            arguments = call.get("arguments")
            if isinstance(arguments, str):  # some parsers keep the JSON text
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = {"input": arguments}
            calls.append(
                {
                    "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                    "name": call.get("name"),
                    "arguments": arguments if isinstance(arguments, dict) else {},
                }
            )
        self.made += len(calls)
        return calls


def _partial_suffix(buffer: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(buffer)), 0, -1):
        if buffer.endswith(marker[:n]):
            return n
    return 0
