"""Admission rules of a generate that depend on the daemon, not on the message alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from moed.daemon.model.chat_template import prompt_token_ids
from moed.daemon.model.loader import load_tokenizer
from moed.protocol import ErrorCode, GenerateRequest, ProtocolError


class DuplicateId(ProtocolError):
    """A generate id already in flight on the connection: answered with `id: nil` and `target`,
    so that a client routing by id does not take it for the running stream's end."""

    def __init__(self, request_id: Any):
        super().__init__(ErrorCode.DUPLICATE_ID, f"request id {request_id!r} is already in flight")
        self.target = request_id


def check_model_name(name: str | None, configured: str, model_path: Path) -> None:
    """`model` may name the configured model, its folder's path or the folder's name."""
    if not name:
        return
    if name not in {configured, str(model_path), model_path.name}:
        raise ProtocolError(
            ErrorCode.MODEL_NOT_FOUND,
            f"model {name!r} is not served here; this daemon serves {configured!r} "
            f"(also known as {model_path.name!r})",
        )


class TokenCounter:
    """`count_tokens`: the model's tokenizer, kept once seen, so an idle (unloaded) daemon counts
    without reloading; encoding is thread-safe, so counting never waits behind a generation."""

    def __init__(self, loaded: Callable[[], Any], model_path: Path):
        self._loaded = loaded
        self._model_path = model_path
        self._tokenizer: Any = None

    def count(self, prompt: GenerateRequest) -> int:
        if self._tokenizer is None:
            loaded = self._loaded()
            if loaded is not None:
                self._tokenizer = loaded.tokenizer
            else:
                self._tokenizer = load_tokenizer(self._model_path)
        return len(prompt_token_ids(self._tokenizer, prompt))
