"""`moed bench stream`'s K-reduction rows: bytes per token and how often the reduced model picks
the token native routing picks."""

from __future__ import annotations

from moed.daemon.bench.stream_report import RunResult


def native_agreement(model, prompt: list[int], native_tokens: list[int]) -> float:
    """Teacher-forced over native routing's own generation: the share of positions where the
    reduced model's greedy next token is native's (one forward pass, no cache)."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.core as mx

    seq = prompt + native_tokens[:-1]
    logits = model(mx.array(seq)[None])
    picked = mx.argmax(logits[0, len(prompt) - 1 :], axis=-1)
    same = picked == mx.array(native_tokens)
    return float(same.astype(mx.float32).mean())


def k_lines(rows: list[tuple[RunResult, int, float]], native: RunResult | None, top_k: int) -> list:
    """One line per K: bytes read per token against the same budget at native top-k, and the
    share of tokens equal to native routing."""
    if not rows:
        return []
    lines = ["", f"K-reduction (lossy, opt-in: --max-active-experts K of top-{top_k}):"]
    base = native.counters["bytes_read"] / max(1, native.decode_tokens) if native else 0.0
    for run, k, agree in rows:
        per_tok = run.counters["bytes_read"] / max(1, run.decode_tokens)
        fewer = ""
        if base and per_tok:  # another routing can also miss more at the same budget
            fewer = (
                f", {base / per_tok:.2f}x fewer bytes than top-{top_k}"
                if per_tok <= base
                else f", {per_tok / base:.2f}x more bytes than top-{top_k} (more misses)"
            )
        lines.append(
            f"  K={k}: {per_tok / 1e6:.2f} MB/token{fewer}; tokens equal to native routing "
            f"{100 * agree:.1f}% (teacher-forced over {len(run.tokens)} tokens), "
            f"{run.tok_s:.2f} tok/s"
        )
    return lines
