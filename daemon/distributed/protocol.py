"""The step protocol between ranks, carried by mx.distributed collectives (never a socket of ours).

Every rank runs the same collectives in the same order. Rank 0 decides what runs next and
broadcasts it; the others follow. A broadcast is an `all_sum` where only rank 0 contributes: a
fixed-size int32 header (the op, the cache list it runs on, the token block's shape), followed by
the body (rank 0's cache operations since the last step, then the tokens) in the same header when
it fits (a decode step) or in one more `all_sum` when it does not (prefill chunks, batch changes).
A step runs a (B, L) block of tokens through each rank's layers on one batched cache, so a batched
decode step is one broadcast of B tokens.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

HEADER_INTS = 64  # 256 bytes: a decode step of up to ~50 sequences fits in one collective
_FIXED = 6  # op, seq, n_handles, n_ops, batch, length


class StepOp(enum.IntEnum):
    FORWARD = 1  # run a (B, L) token block through the layers on one cache list
    STATUS = 2  # every rank contributes its status (all_gather)
    SHED = 3  # shrink every rank's expert cache (the watchdog asked rank 0)
    SHUTDOWN = 4  # leave the follower loop
    PREFIX_LOAD = 5  # after the ops' LOADs: every rank says whether it read its part (all_gather)
    SYNC = 6  # only rank 0's cache operations (an idle engine's: the SSD tier's writes)


class ProtocolMismatch(RuntimeError):
    """Ranks disagree on the step sequence: the group is broken and must restart."""


@dataclass(frozen=True)
class Step:
    op: StepOp
    seq: int  # step number: every rank checks it, so a lost step cannot go unnoticed
    handles: tuple[int, ...] = ()  # the cache list a FORWARD runs on (one batch: B rows)
    ops: tuple[int, ...] = ()  # rank 0's cache operations, applied before the step (cache_ops.py)
    tokens: np.ndarray | None = None  # (B, L) int32 for FORWARD
    arg: int = 0  # SHED: the fraction kept, in per mille

    def encode(self) -> tuple[np.ndarray, np.ndarray | None]:
        b, length = self.tokens.shape if self.tokens is not None else (0, 0)
        head = [int(self.op), self.seq, len(self.handles), len(self.ops), b, length]
        head += [*self.handles]
        if self.op is StepOp.SHED:
            head.append(self.arg)
        if len(head) > HEADER_INTS:
            raise ValueError(f"a step names {len(head)} ints; the header holds {HEADER_INTS}")
        header = np.zeros(HEADER_INTS, dtype=np.int32)
        header[: len(head)] = head
        body = np.array(self.ops, dtype=np.int32)
        if self.tokens is not None:
            body = np.concatenate([body, self.tokens.astype(np.int32).reshape(-1)])
        if len(head) + body.size <= HEADER_INTS:
            header[len(head) : len(head) + body.size] = body
            return header, None
        return header, body


def decode_header(header: np.ndarray) -> tuple[Step, int]:
    """The step (its body still missing if it travels separately) and how many ints follow."""
    op, seq, n_handles, n_ops, b, length = (int(v) for v in header[:_FIXED])
    try:
        step_op = StepOp(op)
    except ValueError:
        raise ProtocolMismatch(
            f"unknown step op {op} (the ranks run different versions?)"
        ) from None
    at = _FIXED
    handles = tuple(int(v) for v in header[at : at + n_handles])
    at += n_handles
    arg = 0
    if step_op is StepOp.SHED:
        arg, at = int(header[at]), at + 1
    step = Step(step_op, seq, handles, (), None, arg)
    n = n_ops + b * length
    if at + n <= HEADER_INTS:
        return with_body(step, header[at : at + n], n_ops, (b, length)), 0
    # Placeholders of the right sizes: `with_body` fills them from the payload.
    return Step(step_op, seq, handles, (0,) * n_ops, np.zeros((b, length), np.int32), arg), n


def with_body(step: Step, body: np.ndarray, n_ops: int, shape: tuple[int, int]) -> Step:
    """`step` with its ops and tokens read from `body` (ops first)."""
    tokens = body[n_ops:].astype(np.int32).reshape(shape) if shape[0] * shape[1] else None
    ops = tuple(int(v) for v in body[:n_ops])
    return Step(step.op, step.seq, step.handles, ops, tokens, step.arg)


@dataclass
class LinkCounters:
    """What the step protocol itself moved (activations are counted by the pipeline)."""

    steps: int = 0
    broadcast_bytes: int = 0
    status_bytes: int = 0
    by_op: dict = field(default_factory=dict)


class StepChannel:
    """Rank 0 sends steps, the other ranks receive them, all through the group's collectives."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.seq = 0
        self.counters = LinkCounters()

    def _broadcast(self, data: np.ndarray | None, n: int, dtype) -> np.ndarray:
        local = data if (self.rank == 0 and data is not None) else np.zeros(n, dtype=dtype)
        out = mx.distributed.all_sum(mx.array(local), group=self.group, stream=mx.cpu)
        mx.eval(out)
        self.counters.broadcast_bytes += local.nbytes * (self.size - 1)
        return np.array(out)

    def send(self, step: Step) -> None:
        """Rank 0: broadcast `step` (its seq is assigned here)."""
        self.seq += 1
        step = Step(step.op, self.seq, step.handles, step.ops, step.tokens, step.arg)
        header, payload = step.encode()
        self._broadcast(header, HEADER_INTS, np.int32)
        if payload is not None:
            self._broadcast(payload, payload.size, np.int32)
        self._count(step.op)

    def receive(self) -> Step:
        """Ranks > 0: the next step rank 0 sent."""
        header = self._broadcast(None, HEADER_INTS, np.int32)
        step, follow = decode_header(header)
        self.seq += 1
        if step.seq != self.seq:
            raise ProtocolMismatch(f"rank {self.rank} expected step {self.seq}, got {step.seq}")
        if follow:
            body = self._broadcast(None, follow, np.int32)
            shape = step.tokens.shape if step.tokens is not None else (0, 0)
            step = with_body(step, body, len(step.ops), shape)
        self._count(step.op)
        return step

    def _count(self, op: StepOp) -> None:
        self.counters.steps += 1
        self.counters.by_op[op.name.lower()] = self.counters.by_op.get(op.name.lower(), 0) + 1

    def gather_json(self, mine: dict) -> list[dict]:
        """Every rank's dict, on every rank (two all_gathers: lengths, then padded bytes)."""
        raw = np.frombuffer(json.dumps(mine, default=float).encode(), dtype=np.uint8)
        lengths = mx.distributed.all_gather(
            mx.array(np.array([raw.size], dtype=np.int32)), group=self.group, stream=mx.cpu
        )
        mx.eval(lengths)
        lengths = np.array(lengths).reshape(-1)
        padded = np.zeros(int(lengths.max()), dtype=np.uint8)
        padded[: raw.size] = raw
        gathered = mx.distributed.all_gather(mx.array(padded), group=self.group, stream=mx.cpu)
        mx.eval(gathered)
        rows = np.array(gathered).reshape(self.size, -1)
        self.counters.status_bytes += padded.nbytes * (self.size - 1)
        return [json.loads(rows[r, : lengths[r]].tobytes()) for r in range(self.size)]
