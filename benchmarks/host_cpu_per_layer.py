"""The streaming layers' own host work per layer call, as thread CPU time with the router
read-back's eval left out: robust to a loaded machine (waits cost no CPU), and it runs unchanged
on older checkouts, so before and after compare in one sitting:

    taskset -c 1 .venv/bin/python benchmarks/host_cpu_per_layer.py 25% 100%
    PYTHONPATH=/path/to/pkg-of-an-old-checkout .venv/bin/python benchmarks/host_cpu_per_layer.py

(the second: a folder holding `moed/daemon`, `moed/protocol`, ... symlinked to the old tree).
`--tokens N` decodes N tokens instead of 64 after the warm-up; `--kinds` also prints the median
per kind of call: all hits, with misses (demand reads), overlapped (resident rows computed while
the misses are read: the step tuner's probe, the first 32 decode steps of every 288).
"""

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from moed.daemon.bench.bench_model import bench_config, write_bench_model
from moed.daemon.experts import streamer as streamer_mod
from moed.daemon.experts import streaming_switch as sw_mod

try:  # the read-back moved out of streamer.py in issue 36
    from moed.daemon.experts import host_route as route_mod
except ImportError:
    route_mod = streamer_mod

try:  # the contenders moved to their own module after f6d9fd9
    from moed.daemon.bench.stream_contenders import _prompt, load_streaming
except ImportError:
    from moed.daemon.bench.stream import _prompt, load_streaming

MODEL = Path("/tmp/moed-host-cpu-model")  # 4 layers x 256 experts, top-8, small hidden
acc = {"layer": 0.0, "eval": 0.0, "calls": 0}
kinds: dict[str, list[float]] = {"hit": [], "miss": [], "overlapped": []}
real_eval = mx.eval


class EvalTimer:
    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def eval(*arrays):
        t = time.thread_time()
        real_eval(*arrays)
        acc["eval"] += time.thread_time() - t


real_call = sw_mod.StreamingSwitch.__call__


def timed(self, x, indices):
    c = self._streamer.counters
    misses, overlapped, evals = sum(lc.misses for lc in c.layers), c.overlapped, acc["eval"]
    t = time.thread_time()
    out = real_call(self, x, indices)
    took = time.thread_time() - t
    acc["layer"] += took
    acc["calls"] += 1
    if c.overlapped > overlapped:
        kind = "overlapped"
    else:
        kind = "miss" if sum(lc.misses for lc in c.layers) > misses else "hit"
    kinds[kind].append(took - (acc["eval"] - evals))
    return out


def main() -> None:
    args = sys.argv[1:]
    tokens, by_kind = 64, "--kinds" in args
    if "--tokens" in args:
        tokens = int(args[args.index("--tokens") + 1])
        del args[args.index("--tokens") : args.index("--tokens") + 2]
    budgets = [a for a in args if not a.startswith("--")] or ["25%", "100%"]
    if not (MODEL / "config.json").exists():
        config = bench_config(4, 256, 128, 256, 8, 1024, bits=4, group=64)
        write_bench_model(MODEL, config, "float32", 0)
    streamer_mod.mx = route_mod.mx = EvalTimer()
    sw_mod.StreamingSwitch.__call__ = timed
    for budget in budgets:
        c = load_streaming(MODEL, budget, 8, "bypass")
        if hasattr(c.streamer, "record_routing"):
            c.streamer.record_routing(trace=False)
        else:  # a checkout before the streamer's one door (issue 35): the attribute itself
            vars(c.streamer)["trace"] = None
        for _ in generate_step(mx.array(_prompt(1, 1024)), c.model, max_tokens=24):
            pass
        acc.update(layer=0.0, eval=0.0, calls=0)
        for v in kinds.values():
            v.clear()
        for _ in generate_step(mx.array(_prompt(2, 1024)), c.model, max_tokens=tokens):
            pass
        host = 1e6 * (acc["layer"] - acc["eval"]) / acc["calls"]
        print(f"{budget}: host CPU per layer call {host:.0f} us over {acc['calls']} calls")
        if by_kind:
            print(
                "  median per call: "
                + ", ".join(
                    f"{k} {1e6 * statistics.median(v):.0f} us (x{len(v)})"
                    for k, v in kinds.items()
                    if v
                )
            )
        c.close()


if __name__ == "__main__":
    main()
