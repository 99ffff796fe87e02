"""The table and ratios `moed bench agent` prints: each cell the median over the side's
conversations, each ratio one of medians (with every conversation's own ratio beside it)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import click

from moed.protocol.units import format_bytes

# What issue 20 asks of one run (see BENCHMARKS.md).
TARGET_NEW_ONLY = 1.3  # last turn's TTFT / TTFT of its new tokens read alone
TARGET_VS_MLX_LM = 1.0  # last turn's TTFT / mlx_lm.server's last turn
TARGET_RESTART = 1.5  # first turn after a restart / the warm last turn


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _column(side, pick) -> list:
    """One cell's values over the side's conversations (None where a conversation lacks it)."""
    return [pick(run) for run in side.runs]


def _ttft(turns) -> float | None:
    return _median(t.ttft_s if t is not None else None for t in turns)


def print_report(header: dict, results: list, bound=None) -> None:
    n = header["turns"]
    click.echo(
        f"moed bench agent: {header['model']}  system prompt {header['system_tokens']} tokens, "
        f"{n} turns of {header['user_tokens']} user tokens + the answers, "
        f"{header['max_tokens']} tokens per answer, prefill chunk {header['prefill_chunk']}, "
        f"{header['repeats']} conversations per side"
        + (f", moed as a pipeline of {header['ranks']} ranks" if header.get("ranks", 1) > 1 else "")
    )
    picks: list[Callable[..., Any]] = [
        lambda r, k=k: r.turns[k] if k < len(r.turns) else None for k in range(n)
    ]
    picks += [lambda r: r.restarted, lambda r: r.new_only]
    cols = [str(k + 1) for k in range(n)] + ["restart", "new only"]
    click.echo(
        "\ntime to first token, seconds (median; mlx_lm.server's turns sent beside each side's)"
    )
    click.echo(f"{'':<16}" + "".join(f"{c:>9}" for c in cols))
    for r in _rows(results):
        cells = [_ttft(_column(r, pick)) for pick in picks]
        click.echo(f"{r.name:<16}" + "".join(f"{_s(c):>9}" for c in cells))
    click.echo("\ncached / prompt tokens (first conversation)")
    click.echo(f"{'':<16}" + "".join(f"{c:>12}" for c in cols))
    for r in _rows(results):
        cells = [pick(r.runs[0]) for pick in picks] if r.runs else []
        click.echo(f"{r.name:<16}" + "".join(f"{_cached(t):>12}" for t in cells))
    streamed = [
        r for r in results if any(t.read_bytes is not None for x in r.runs for t in x.turns)
    ]
    if streamed:
        click.echo(
            "\nexpert bytes read by the first token, per prompt token read (streaming, median); "
            "in all by the first token"
        )
        click.echo(f"{'':<16}" + "".join(f"{c:>10}" for c in cols))
        for r in streamed:
            cells = [_median(_per_token(t) for t in _column(r, pick)) for pick in picks]
            click.echo(f"{r.name:<16}" + "".join(f"{_bytes(c):>10}" for c in cells))
            cells = [_median(_first_bytes(t) for t in _column(r, pick)) for pick in picks]
            click.echo(f"{'':<16}" + "".join(f"{_bytes(c):>10}" for c in cells))
    click.echo(
        "\nratios of medians (each conversation's own in parentheses; issue 20's targets in [])"
    )
    for r in results:
        if not r.runs:
            continue
        last = _column(r, picks[n - 1])
        mlx_last = [run.turns[n - 1] for run in r.beside]
        alone = _column(r, lambda x: x.new_only)
        restarted = _column(r, lambda x: x.restarted)
        click.echo(
            f"{r.name:<16}turn {n} / its new tokens alone "
            f"{_ratio(_ttft(last), _ttft(alone))} {_each(last, alone)} [<= {TARGET_NEW_ONLY}]"
        )
        click.echo(
            f"{'':<16}turn {n} / mlx_lm.server's beside it {_ratio(_ttft(last), _ttft(mlx_last))} "
            f"{_each(last, mlx_last)} [<= {TARGET_VS_MLX_LM}]"
        )
        click.echo(
            f"{'':<16}after a restart / warm turn {n} "
            f"{_ratio(_ttft(restarted), _ttft(last))} {_each(restarted, last)} "
            f"[<= {TARGET_RESTART}]"
        )
    if bound is not None:
        click.echo(
            f"\nthe model's own floor for the first ratio (plain mlx-lm, no server): turn {n}'s "
            f"new tokens read after their cached context {bound.after_context_s:.3f} s, alone "
            f"{bound.alone_s:.3f} s: {bound.ratio:.2f}x (attention to the context; no prefix "
            "cache reads the new tokens for less)"
        )


def _rows(results: list) -> list:
    """Each side, then mlx_lm.server's turns sent beside it."""
    out = []
    for r in results:
        out.append(r)
        if r.beside:
            out.append(type(r)("  mlx_lm.server", r.beside))
    return out


def _each(num, den) -> str:
    pairs = [(a.ttft_s, b.ttft_s) for a, b in zip(num, den) if a is not None and b is not None]
    return "(" + " ".join(f"{a / b:.2f}" for a, b in pairs if b) + ")"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _cached(t) -> str:
    if t is None or t.prompt_tokens is None:
        return "-"
    return f"{t.cached_tokens if t.cached_tokens is not None else '-'}/{t.prompt_tokens}"


def _first_bytes(t) -> float | None:
    return None if t is None else t.first_read_bytes


def _per_token(t) -> float | None:
    if t is None or t.first_read_bytes is None or t.prompt_tokens is None:
        return None
    return t.first_read_bytes / max(t.prompt_tokens - (t.cached_tokens or 0), 1)


def _bytes(x: float | None) -> str:
    return "-" if x is None else format_bytes(x)
