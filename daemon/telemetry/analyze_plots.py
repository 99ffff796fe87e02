"""`moed trace analyze --plots DIR`: the analysis as PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moed.daemon.telemetry.analyze import BELADY, Report
from moed.daemon.telemetry.trace import CLASSES


def write_plots(r: Report, out: Path) -> list[Path]:
    """PNG plots (matplotlib, Agg backend): hit rate vs cache size, popularity, reuse, per pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [100.0 * s / r.experts for s in r.sizes]
    for n, (name, curve) in enumerate(r.curves.items()):
        label = name + (" (daemon)" if name == r.policy_name else "")
        label = f"{BELADY} (offline optimum)" if name == BELADY else label
        ax.plot(
            x,
            [100 * v for v in curve],
            "^-" if name == BELADY else "os*dv"[n % 5] + "-",
            label=label,
        )
    ax.axvline(100.0 * r.recorded_slots / r.experts, color="grey", ls=":", label="recorded budget")
    if x and x[-1] / x[0] > 10:
        ax.set_xscale("log")  # the grid is geometric: small caches are where the curves differ
    ax.set_xlabel("expert cache size (% of each layer's experts)")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{r.model}: hit rate vs cache size ({r.tokens} tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "hit_rate_vs_cache.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    share = r.popularity / np.maximum(1, r.popularity.sum(axis=1, keepdims=True))
    im = a1.imshow(100 * share, aspect="auto", cmap="viridis", interpolation="nearest")
    a1.set_xlabel("expert id")
    a1.set_ylabel("MoE layer")
    a1.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    a1.set_title("routing share per expert (%)")
    fig.colorbar(im, ax=a1)
    for layer in range(r.layers):
        ranked = np.sort(share[layer])[::-1]
        a2.plot(
            100 * np.arange(0, r.experts + 1) / r.experts,
            100 * np.concatenate([[0], np.cumsum(ranked)]),
            alpha=0.6,
        )
    a2.plot([0, 100], [0, 100], "k:", label="uniform")
    a2.set_xlabel("most used experts (% of the layer)")
    a2.set_ylabel("routings covered (%)")
    a2.set_title("popularity: cumulative share, one line per layer")
    a2.grid(alpha=0.3)
    a2.legend()
    paths.append(_save(fig, out / "popularity.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    layers = [l.layer for l in r.per_layer]
    ax.bar(
        layers,
        [100 * l.unique / l.experts for l in r.per_layer],
        alpha=0.5,
        label="distinct experts used (% of layer)",
    )
    ax.plot(
        layers,
        [100 * l.reuse for l in r.per_layer],
        "o-",
        color="C3",
        label="token-to-token reuse (%)",
    )
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.set_title("distinct experts and token-to-token reuse per layer")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / "reuse.png"))

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    idx = np.arange(len(r.pass_ms))
    a1.plot(idx, r.pass_ms, label="pass wall ms", color="k", lw=1)
    a1.plot(idx, r.pass_stall_ms, label="stall on reads ms", color="C3", lw=1)
    a1.plot(idx, r.pass_router_ms, label="router read-back ms", color="C0", lw=1)
    a1.set_yscale("log")
    a1.set_ylabel("ms")
    a1.set_title("why each forward pass took its time (pass 0 is the prompt)")
    a1.legend()
    a1.grid(alpha=0.3)
    cls = np.array(r.pass_classes, dtype=float).reshape(-1, len(CLASSES))
    bottom = np.zeros(len(idx))
    for i, name in enumerate(CLASSES):
        if cls[:, i].any():
            a2.bar(idx, cls[:, i], bottom=bottom, label=name, width=1.0)
            bottom += cls[:, i]
    a2.set_xlabel("forward pass")
    a2.set_ylabel("experts (all layers)")
    a2.legend()
    paths.append(_save(fig, out / "passes.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
