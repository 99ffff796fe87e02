"""Greedy and seeded decode tokens streamed against the resident model's, on whatever device MLX
runs (a Mac's Metal, CUDA, this CPU), for the test fixtures' architectures at several budgets,
each with `launch_early` (a host-routed layer's output submitted once built) on and off:

    python benchmarks/decode_exactness.py [TOKENS] [ARCH ...]

The checkpoints are the tests' own (tests/fixtures/checkpoints.py), written to a temporary folder.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository root: tests.fixtures

from tests.fixtures.checkpoints import write_checkpoint  # noqa: E402
from tests.fixtures.reference import SAMPLER, decode, resident, streaming  # noqa: E402

ARCHS = ("qwen3_moe", "qwen3_5_moe")
BUDGETS = ("10%", "25%", "100%")
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]  # routes to every expert: several passes


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    print(f"device {mx.default_device()}, {tokens} tokens after a {len(PROMPT)}-token prompt")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for arch in sys.argv[2:] or ARCHS:
            path = write_checkpoint(Path(tmp) / arch, arch, num_layers=4, num_experts=16, bits=4)
            model = resident(path)
            want = decode(model, PROMPT, tokens), decode(model, PROMPT, tokens, SAMPLER)
            again = decode(model, PROMPT, tokens), decode(model, PROMPT, tokens, SAMPLER)
            del model
            # Is the device itself deterministic? The resident model's second run, the same way.
            same = ["yes" if g == w else "NO" for g, w in zip(again, want)]
            print(f"{arch:>12} resident again       greedy {same[0]:>3} seeded {same[1]:>3}")
            for budget in BUDGETS:
                for early in (True, False):
                    model, streamer = streaming(path, budget, launch_early=early)
                    try:
                        got = decode(model, PROMPT, tokens), decode(model, PROMPT, tokens, SAMPLER)
                    finally:
                        streamer.close()
                    same = ["yes" if g == w else "NO" for g, w in zip(got, want)]
                    failed += same.count("NO")
                    at = [
                        next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), -1)
                        for g, w in zip(got, want)
                    ]
                    print(
                        f"{arch:>12} {budget:>5} launch_early={'on ' if early else 'off'} "
                        f"greedy {same[0]:>3} seeded {same[1]:>3} (first difference at {at})"
                    )
    print("all identical" if not failed else f"{failed} differ")


if __name__ == "__main__":
    main()
