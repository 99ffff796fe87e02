"""Two daemons side by side on the same agent turns, paired: each side (a daemon and its gateway)
plays the same 5-turn conversation, then TURNS more turns each sending that history plus new user
text (a prefix hit), the sides taking each turn one right after the other (the order alternating),
so both see the same machine at the same moment. A side is serve arguments, with NAME=value words
set in its processes' environment first: `PYTHONPATH=<dir holding a `moed` link to another
checkout>` runs another version of the code. Prints each side's median time to first token and
the median of its per-turn ratios to the first side's (drift on a shared machine cancels there).

    .venv/bin/python benchmarks/agent_turn_pairs.py MODEL 40 \
        "PYTHONPATH=/tmp/oldpkg --cache-budget 25%" "--cache-budget 25%"
"""

import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from mlx_lm.utils import load_tokenizer

from moed.daemon.bench.agent import MoedSide, make_conversation, timed_turn


def start_side(index: int, model: Path, spec: str) -> MoedSide:
    words = shlex.split(spec)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    args = [w for w in words if not ("=" in w and not w.startswith("-"))]
    saved = dict(os.environ)
    os.environ.update(env)  # the daemon and the gateway inherit it
    try:
        side = MoedSide(
            f"side{index}",
            model,
            Path(tempfile.mkdtemp(prefix="agent-pairs-")),
            ("--prefill-chunk", "256", *args),
        )
        side.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return side


def main() -> None:
    model, turns, specs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    tok = load_tokenizer(model)
    conv = make_conversation(tok, 1500, 6, 60, 16, 7)
    sides: list[MoedSide] = []
    try:
        for i, spec in enumerate(specs):
            sides.append(start_side(i, model, spec))
        with httpx.Client() as http:
            histories = []
            for side in sides:
                model_id = http.get(f"{side.url}/v1/models").json()["data"][0]["id"]
                history = conv.system
                for user in conv.users[:5]:
                    _, answer = timed_turn(http, side.url, model_id, history + user, 16)
                    history += user + answer
                histories.append((model_id, history))
            rng = random.Random(7)
            times: list[list[float]] = [[] for _ in sides]
            for t in range(turns):
                new = [rng.randrange(100, 2000) for _ in range(60)]
                user = f"\nUser: {tok.decode(new)}\nAssistant:"
                order = range(len(sides)) if t % 2 == 0 else reversed(range(len(sides)))
                for i in order:
                    model_id, history = histories[i]
                    result, _ = timed_turn(http, sides[i].url, model_id, history + user, 16)
                    times[i].append(result.ttft_s)
                time.sleep(0.05)  # each side's SSE writes of the turn land before the next
    finally:
        for side in sides:
            side.stop()
            shutil.rmtree(side.dir.parent, ignore_errors=True)  # its state, logs and SSD tier
    for spec, ts in zip(specs, times):
        paired = statistics.median(a / b for a, b in zip(ts, times[0]))
        print(f"[{spec}] median {statistics.median(ts) * 1e3:.1f} ms, {paired:.3f}x the first side")


if __name__ == "__main__":
    main()
