"""Time to first token of agent turns through the gateway: a resident daemon on MODEL plays a
5-turn conversation, then TURNS more turns each sending that history plus new user text (a prefix
hit on the history); daemons started with each serve-argument set in turn, ROUNDS times
alternating, so the sets see the same machine (resident unless a set gives --cache-budget).
Prints each run's median and the sets' medians.

    .venv/bin/python benchmarks/agent_turn_ttft.py MODEL [TURNS] [ROUNDS] \
        -- "" "--prefix-cache-disk 0"
    .venv/bin/python benchmarks/agent_turn_ttft.py MODEL 25 2 \
        -- "" "--cache-budget 25%" "--cache-budget 25% --prefetch-workers 1"
"""

import random
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
from mlx_lm.utils import load_tokenizer

from moed.daemon.bench.agent import MoedSide, make_conversation, timed_turn


def run(model: Path, args: tuple[str, ...], turns: int, seed: int) -> float:
    tok = load_tokenizer(model)
    conv = make_conversation(tok, 1500, 6, 60, 16, seed)
    side = MoedSide("resident", model, Path(tempfile.mkdtemp(prefix="agent-ttft-")), args)
    side.start()
    rng = random.Random(seed)
    try:
        with httpx.Client() as http:
            model_id = http.get(f"{side.url}/v1/models").json()["data"][0]["id"]
            history = conv.system
            for user in conv.users[:5]:
                _, answer = timed_turn(http, side.url, model_id, history + user, 16)
                history += user + answer
            times = []
            for _ in range(turns):
                new = [rng.randrange(100, 2000) for _ in range(60)]
                user = f"\nUser: {tok.decode(new)}\nAssistant:"
                times.append(timed_turn(http, side.url, model_id, history + user, 16)[0].ttft_s)
            return statistics.median(times)
    finally:
        side.stop()


def main() -> None:
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    head, sets = sys.argv[1:split], sys.argv[split + 1 :] or [""]
    model = Path(head[0])
    turns = int(head[1]) if len(head) > 1 else 25
    rounds = int(head[2]) if len(head) > 2 else 2
    base = ("--prefill-chunk", "256")
    medians: dict[str, list[float]] = {s: [] for s in sets}
    for r in range(rounds):
        for s in sets:
            args = shlex.split(s)
            if "--cache-budget" not in args:  # resident unless the set streams
                args.insert(0, "--resident")
            t = run(model, (*base, *args), turns, 7 + r)
            medians[s].append(t)
            print(f"[{s or 'defaults'}] round {r}: median time to first token {t * 1e3:.1f} ms")
    first = statistics.median(medians[sets[0]])
    for s in sets:
        m = statistics.median(medians[s])
        print(f"[{s or 'defaults'}] {m * 1e3:.1f} ms, {m / first:.3f}x the first set")


if __name__ == "__main__":
    main()
