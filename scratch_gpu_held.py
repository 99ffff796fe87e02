"""Throwaway: where the held path's remaining time goes on a GPU (not committed)."""
import sys
from pathlib import Path

import mlx.core as mx

from moed.daemon.bench.stream_contenders import _prompt, load_resident, load_streaming, measure
from moed.daemon.bench.stream_report import paired_speed

path = Path(sys.argv[1])
files = sorted(path.glob("model*.safetensors"))
res = load_resident(path)
variants = {}
for name in ("pre", "pre-notally", "pre-devcopy", "pre-both"):
    c = load_streaming(path, "100%", 8, "bypass", preload_all=True)
    c.name = name
    s = c.streamer
    for layer in range(len(s.pools)):
        s.on_device(layer)
    if "notally" in name or "both" in name:
        s.tally.flush = lambda: None
        s.tally.record = lambda layer, idx: None
    if "devcopy" in name or "both" in name:
        for p in s.pools:
            p.arrays = {k: mx.take(v, mx.arange(v.shape[0]), axis=0) for k, v in p.arrays.items()}
            mx.eval(list(p.arrays.values()))
    variants[name] = c
cs = [res, *variants.values()]
measure(cs, files, _prompt(1, 8192), _prompt(2, 8192), 16, 64)
r0 = res.result()
print(f"resident {r0.tok_s:.1f} tok/s")
for c in variants.values():
    r = c.result()
    print(f"{c.name:12s} {r.tok_s:7.1f} tok/s  x res {paired_speed(r, r0):.3f}  same {r.tokens == r0.tokens}")

# Where the host time of a streamed (25%) layer call goes, on a quiet fast CPU.
import cProfile
import pstats
import time

from mlx_lm.generate import generate_step

c = load_streaming(path, "25%", 8, "bypass")
c.streamer.trace = None
for _ in generate_step(mx.array(_prompt(1, 8192)), c.model, max_tokens=24):
    pass
s0 = c.streamer.snapshot()
pr = cProfile.Profile()
t0 = time.perf_counter()
pr.enable()
for _ in generate_step(mx.array(_prompt(2, 8192)), c.model, max_tokens=64):
    pass
pr.disable()
s1 = c.streamer.snapshot()
n = s1["layer_calls"] - s0["layer_calls"]
print(f"25% profiled: {n} layer calls in {time.perf_counter() - t0:.2f} s")
for k in ("layer_s", "router_sync_s", "router_copy_s", "stall_s", "expert_compute_s"):
    print(f"  {k}: {1e6 * (s1[k] - s0[k]) / n:.0f} us/call")
pstats.Stats(pr).sort_stats("tottime").print_stats(45)
