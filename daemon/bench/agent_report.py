"""The table and ratios `moed bench agent` prints."""

from __future__ import annotations

import click

from moed.protocol.units import format_bytes

# What issue 20 asks of one run (see BENCHMARKS.md).
TARGET_NEW_ONLY = 1.3  # last turn's TTFT / TTFT of its new tokens read alone
TARGET_VS_MLX_LM = 1.0  # last turn's TTFT / mlx_lm.server's last turn
TARGET_RESTART = 1.5  # first turn after a restart / the warm last turn


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def print_report(header: dict, results: list) -> None:
    n = header["turns"]
    click.echo(
        f"moed bench agent: {header['model']}  system prompt {header['system_tokens']} tokens, "
        f"{n} turns of {header['user_tokens']} user tokens + the answers, "
        f"{header['max_tokens']} tokens per answer, prefill chunk {header['prefill_chunk']}"
    )
    cols = [str(k + 1) for k in range(n)] + ["restart", "new only"]
    click.echo("\ntime to first token, seconds")
    click.echo(f"{'':<16}" + "".join(f"{c:>9}" for c in cols))
    for r in results:
        cells = [t.ttft_s for t in r.turns] + [
            r.restarted.ttft_s if r.restarted else None,
            r.new_only.ttft_s if r.new_only else None,
        ]
        click.echo(f"{r.name:<16}" + "".join(f"{_s(c):>9}" for c in cells))
    click.echo("\ncached / prompt tokens")
    for r in results:
        turns = r.turns + ([r.restarted] if r.restarted else [])
        click.echo(f"{r.name:<16}" + "".join(f"{_cached(t):>12}" for t in turns))
    streamed = [r for r in results if any(t.read_bytes is not None for t in r.turns)]
    if streamed:
        click.echo("\nexpert bytes read per prompt token read (streaming)")
        for r in streamed:
            turns = r.turns + ([r.restarted] if r.restarted else [])
            click.echo(f"{r.name:<16}" + "".join(f"{_per_token(t):>10}" for t in turns))
    mlx = next((r for r in results if r.name == "mlx_lm.server"), None)
    click.echo("\nratios (issue 20's targets in brackets)")
    for r in results:
        if r is mlx or not r.turns:
            continue
        last = r.turns[-1].ttft_s
        click.echo(
            f"{r.name:<16}turn {n} / its new tokens alone "
            f"{_ratio(last, r.new_only.ttft_s if r.new_only else None)} [<= {TARGET_NEW_ONLY}]  "
            f"turn {n} / mlx_lm.server's "
            f"{_ratio(last, mlx.turns[-1].ttft_s if mlx else None)} [<= {TARGET_VS_MLX_LM}]  "
            f"after a restart / warm turn {n} "
            f"{_ratio(r.restarted.ttft_s if r.restarted else None, last)} [<= {TARGET_RESTART}]"
        )


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _cached(t) -> str:
    if t.prompt_tokens is None:
        return "-"
    return f"{t.cached_tokens if t.cached_tokens is not None else '-'}/{t.prompt_tokens}"


def _per_token(t) -> str:
    if t.read_bytes is None or t.prompt_tokens is None:
        return "-"
    read = t.prompt_tokens - (t.cached_tokens or 0)
    return format_bytes(t.read_bytes / max(read, 1))
