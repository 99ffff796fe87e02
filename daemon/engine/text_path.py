"""One request's text path, contained: the stages between its row's sampled token and its client
(detokenizing, the reasoning split, tool calls, stop strings, the grammar, logprobs).

An exception in a stage is that request's own failure: it ends with `poison_request` naming the
stage, and the engine, the batch's other rows and the daemon carry on. A debug fault
(ground/faults.py, `text_<stage>_after`) raises at the same points in a hostile request.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from moed.daemon.ground.faults import Faults, TextStage
from moed.protocol import ErrorCode, ProtocolError


class RowFailed(Exception):
    """A stage of one row's text path raised: that request fails alone."""

    def __init__(self, stage: TextStage | None, cause: BaseException):
        where = f"its {stage.value} stage" if stage is not None else "its text path"
        super().__init__(f"{where}: {cause.__class__.__name__}: {cause}")
        self.stage = stage
        self.cause = cause
        self.message = (
            f"this request failed in {where} ({cause.__class__.__name__}: {str(cause)[:300]}); "
            "it is not retried, and the daemon serves on"
        )


def failure_of(exc: BaseException) -> tuple[ErrorCode, str]:
    """The typed error a row ends with when its text path raised `exc`."""
    if isinstance(exc, ProtocolError):  # a refusal the row met late (its grammar cannot go on)
        return exc.code, exc.message
    row = exc if isinstance(exc, RowFailed) else RowFailed(None, exc)
    return ErrorCode.POISON_REQUEST, row.message


class _Stage:
    __slots__ = ("_guard", "_stage")

    def __init__(self, guard: TextGuard, stage: TextStage):
        self._guard = guard
        self._stage = stage

    def __enter__(self) -> None:
        guard = self._guard
        if guard.faults is not None and self._stage in guard.hostile:
            faults = guard.faults
            try:
                faults.in_text(self._stage, guard.tokens)
            except Exception as exc:
                raise RowFailed(self._stage, exc) from exc

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, Exception) and not isinstance(exc, (RowFailed, ProtocolError)):
            raise RowFailed(self._stage, exc) from exc


class TextGuard:
    """Wraps each stage of one row: `with guard(TextStage.X): ...` turns what the stage raises
    into RowFailed; with text faults on, a hostile request's stages raise (ground/faults.py)."""

    __slots__ = ("faults", "hostile", "tokens")

    def __init__(self, faults: Faults | None = None, hostile: frozenset[TextStage] = frozenset()):
        self.faults = faults if hostile else None
        self.hostile = hostile  # the stages a debug fault hits in this row
        self.tokens = 0  # the row's tokens so far (when a text fault fires)

    @classmethod
    def for_prompt(cls, faults: Faults | None, tokenizer: Any, prompt_ids: list[int]) -> TextGuard:
        """A row's guard: armed only for a prompt that names a stage after HOSTILE_MARKER."""
        if faults is None or not faults.text_after:
            return cls()
        return cls(faults, faults.hostile_stages(tokenizer.decode(prompt_ids)))

    def __call__(self, stage: TextStage) -> _Stage:
        return _Stage(self, stage)
