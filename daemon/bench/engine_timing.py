"""The engine core in the benchmark's own process, with no socket: its decode rate beside mlx-lm's
tells the engine's share of `bench serve`'s gap from the share of the daemon and gateway hops."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from moed.daemon.bench.run_timing import RunTiming, decode_tps
from moed.daemon.config import ServeConfig
from moed.daemon.engine.status import EngineStatus
from moed.protocol import EngineEvent, GenerateRequest, TokenEvent, validate_generate
from moed.protocol.generate import RequestId


class _StampSink:
    """Takes the engine's events as the transport would, stamping each token as it is emitted."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.tokens: list[int] = []

    def emit(self, identity: bytes, request_id: RequestId, event: EngineEvent) -> None:
        if isinstance(event, TokenEvent) and event.ids:
            self.stamps.append(time.perf_counter())
            self.tokens.extend(event.ids)


class InProcessCore:
    """An EngineCore on the model (a second copy in this process: for small models), driven as
    the engine thread drives it, one generate at a time."""

    def __init__(self, model_path: Path, state_dir: Path):
        # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
        from moed.daemon.engine.core import EngineCore

        self.sink = _StampSink()
        serve = ServeConfig(model=str(model_path), state_dir=state_dir, resident=True)
        self.core = EngineCore(serve, model_path, self.sink, EngineStatus())
        if not self.core.load():
            raise RuntimeError(f"the engine core could not load {model_path}")
        self._ids = itertools.count()

    def time(self, prompt_ids: list[int], max_tokens: int) -> RunTiming:
        # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
        from moed.daemon.engine.commands import Submit
        from moed.daemon.engine.request import GenerateJob

        self.sink.stamps, self.sink.tokens = [], []
        request_id = f"core-{next(self._ids)}"
        request = GenerateRequest(
            prompt_ids=tuple(prompt_ids), max_tokens=max_tokens, telemetry_every=1 << 30
        )
        # What the transport checks before it submits.
        request = validate_generate(request.to_wire(request_id))
        t0 = time.perf_counter()
        self.core.handle(Submit(GenerateJob(b"bench", request_id, request)))
        while self.core.has_work:
            self.core.step()
        stamps = self.sink.stamps
        return RunTiming(stamps[0] - t0, decode_tps(stamps), list(self.sink.tokens))

    def close(self) -> None:
        self.core.close()
