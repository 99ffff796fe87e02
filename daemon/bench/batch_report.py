"""What `moed bench batch` prints and writes: the clients table, the long-prompt table, and the
exactness of concurrent greedy streams against the same prompts run alone."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import click

from moed.daemon.bench.batch_clients import (
    CellResult,
    LongPromptResult,
    StreamRecord,
    percentile,
)


@dataclass(frozen=True)
class Solo:
    """A prompt generated alone: its tokens and, per token, the top-2 logprob margin (how near a
    tie the greedy choice was)."""

    tokens: list[int]
    margins: list[float]
    logprobs: list[float]  # the top-1 (greedy) token's logprob, per token

    @classmethod
    def of(cls, record: StreamRecord) -> Solo:
        margins = [
            t[0]["logprob"] - t[1]["logprob"] if len(t) > 1 else float("inf") for t in record.top
        ]
        return cls(list(record.tokens), margins, [t[0]["logprob"] for t in record.top])


def logprob_drift(solos: list[Solo], records: list[StreamRecord]) -> tuple[float, int]:
    """The largest |logprob difference| of the greedy token between concurrent streams (asked
    with logprobs) and the same prompts alone, over their common prefix; and tokens compared."""
    worst, compared = 0.0, 0
    for solo, rec in zip(solos, records):
        for n, (a, b) in enumerate(zip(solo.tokens, rec.tokens)):
            if a != b or n >= len(rec.top) or n >= len(solo.logprobs):
                break
            worst = max(worst, abs(rec.top[n][0]["logprob"] - solo.logprobs[n]))
            compared += 1
    return worst, compared


@dataclass(frozen=True)
class Divergence:
    prompt: int
    index: int  # the first token that differs from the solo run
    solo_margin: float  # the solo run's top-1 minus top-2 logprob at that token (nats)


def compare(solo: Solo, tokens: list[int], prompt: int) -> Divergence | None:
    """None when `tokens` equal the solo run's; else where they first differ."""
    if tokens == solo.tokens:
        return None
    n = next(
        (i for i, (a, b) in enumerate(zip(tokens, solo.tokens)) if a != b),
        min(len(tokens), len(solo.tokens)),
    )
    margin = solo.margins[n] if n < len(solo.margins) else float("nan")
    return Divergence(prompt, n, margin)


@dataclass
class Cell:
    """Every round of one (side, clients) cell."""

    side: str
    clients: int
    runs: list[CellResult] = field(default_factory=list)
    same: int = 0  # streams whose tokens equal the solo run of their prompt
    streams: int = 0
    divergences: list[Divergence] = field(default_factory=list)

    def add(self, result: CellResult, records: list[StreamRecord], solos: list[Solo]) -> None:
        self.runs.append(result)
        for i, rec in enumerate(records):
            self.streams += 1
            diff = compare(solos[i], rec.tokens, i)
            if diff is None:
                self.same += 1
            else:
                self.divergences.append(diff)

    @property
    def total_tps(self) -> float:
        return statistics.median(r.total_tps for r in self.runs)

    def row(self, base_tps: float) -> dict:
        gaps = [g for r in self.runs for g in r.gaps_ms]
        ttft = [t for r in self.runs for t in r.ttft_ms]
        return {
            "side": self.side,
            "clients": self.clients,
            "total_tps": round(self.total_tps, 2),
            "ratio_vs_1_client": round(self.total_tps / base_tps, 3) if base_tps else None,
            "per_client_tps": round(statistics.median(r.per_client_tps for r in self.runs), 2),
            "gap_p50_ms": round(percentile(gaps, 0.5), 3),
            "gap_p99_ms": round(percentile(gaps, 0.99), 3),
            "ttft_ms": round(statistics.median(ttft), 3),
            "tokens_per_run": [r.tokens for r in self.runs],
            "total_tps_runs": [round(r.total_tps, 2) for r in self.runs],
            "identical_to_solo": self.same,
            "streams": self.streams,
            "divergences": [d.__dict__ for d in self.divergences],
        }


def print_clients(rows: list[dict]) -> None:
    click.echo(
        f"{'side':>9}{'clients':>8}{'total tok/s':>13}{'x 1 client':>11}{'per client':>12}"
        f"{'gap p50':>9}{'gap p99':>9}{'TTFT':>9}{'same as solo':>14}"
    )
    for r in rows:
        click.echo(
            f"{r['side']:>9}{r['clients']:>8}{r['total_tps']:>13.1f}{_ratio(r):>11}"
            f"{r['per_client_tps']:>12.1f}{r['gap_p50_ms']:>7.1f}ms{r['gap_p99_ms']:>7.1f}ms"
            f"{r['ttft_ms']:>7.1f}ms{r['identical_to_solo']:>9}/{r['streams']}"
        )


def _ratio(row: dict) -> str:
    ratio = row["ratio_vs_1_client"]
    return "-" if ratio is None else f"{ratio:.2f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def long_row(side: str, runs: list[LongPromptResult]) -> dict:
    def med(name: str) -> float:
        return round(statistics.median(getattr(r, name) for r in runs), 3)

    base = med("base_gap_ms")
    ratios = [r.window_p99_ms / r.base_gap_ms for r in runs if r.base_gap_ms]
    return {
        "side": side,
        "median_gap_ms": med("median_gap_ms"),
        "base_gap_ms": base,
        "window_p50_ms": med("window_p50_ms"),
        "window_p99_ms": med("window_p99_ms"),
        "window_max_ms": med("window_max_ms"),
        "window_gaps": [r.window_gaps for r in runs],
        # Paired: each round's p99 over the same round's baseline, then the median over rounds.
        "p99_over_base": round(statistics.median(ratios), 2) if ratios else None,
        "p99_over_base_runs": [round(x, 2) for x in ratios],
        "stream_p99_ms": med("stream_p99_ms"),
        "long_ttft_ms": med("long_ttft_ms"),
        "covered": all(r.covered for r in runs),
    }


def print_long(rows: list[dict], prompt_tokens: int, streams: int) -> None:
    click.echo(
        f"\na {prompt_tokens}-token prompt arriving while {streams} streams decode "
        "(their time per token before the prompt, and their gaps between tokens in the window "
        "from its send to its first token; medians over rounds, p99/before paired by round)"
    )
    click.echo(
        f"{'side':>9}{'gap before':>12}{'p50 in window':>15}{'p99 in window':>15}"
        f"{'max in window':>15}{'p99/before':>12}{'prompt TTFT':>13}"
    )
    for r in rows:
        click.echo(
            f"{r['side']:>9}{r['base_gap_ms']:>10.1f}ms{r['window_p50_ms']:>13.1f}ms"
            f"{r['window_p99_ms']:>13.1f}ms{r['window_max_ms']:>13.1f}ms"
            f"{_num(r['p99_over_base']):>12}{r['long_ttft_ms']:>11.1f}ms"
            + ("" if r["covered"] else "  (a stream ended before the prompt's first token)")
        )


def print_exactness(rows: list[dict], solos: list[Solo]) -> dict:
    """How often concurrent greedy streams equal their prompt alone, and where they differ."""
    concurrent = [r for r in rows if r["clients"] > 1]
    same = sum(r["identical_to_solo"] for r in concurrent)
    streams = sum(r["streams"] for r in concurrent)
    alone = [r for r in rows if r["clients"] == 1]
    alone_same = sum(r["identical_to_solo"] for r in alone)
    alone_streams = sum(r["streams"] for r in alone)
    divs = [d for r in concurrent for d in r["divergences"]]
    all_margins = [m for s in solos for m in s.margins if m != float("inf")]
    click.echo(
        f"\nexactness (greedy): {alone_same}/{alone_streams} single-client streams and "
        f"{same}/{streams} concurrent streams equal the same prompt generated alone"
    )
    by_clients: dict[int, list[int]] = {}
    for r in concurrent:
        acc = by_clients.setdefault(r["clients"], [0, 0])
        acc[0] += r["identical_to_solo"]
        acc[1] += r["streams"]
    if by_clients:
        click.echo(
            "  by clients: "
            + ", ".join(f"{n}: {a}/{b}" for n, (a, b) in sorted(by_clients.items()))
        )
    summary = {
        "single_identical": alone_same,
        "single_streams": alone_streams,
        "concurrent_identical": same,
        "concurrent_streams": streams,
        "solo_margin_median": statistics.median(all_margins) if all_margins else None,
    }
    if divs:
        first = [d["index"] for d in divs]
        margins = [d["solo_margin"] for d in divs]
        small = sum(1 for m in all_margins if m <= max(margins))
        click.echo(
            f"  differing streams: first differing token at index {min(first)}-{max(first)} "
            f"(median {statistics.median(first):.0f}); the solo run's top-1 minus top-2 logprob "
            f"there: median {statistics.median(margins):.2e}, max {max(margins):.2e} nats "
            f"(over all solo tokens: median {summary['solo_margin_median']:.2f}; "
            f"{small}/{len(all_margins)} tokens are that close)"
        )
        summary.update(
            first_index_median=statistics.median(first),
            divergence_margin_median=statistics.median(margins),
            divergence_margin_max=max(margins),
        )
    return summary
