"""Under a cgroup memory limit of 60% of the checkpoint, streaming finishes a generation identical
to the resident one and its peak memory stays under the limit. Root on Linux only.

The generation runs in a child process placed in the cgroup before it starts (its pid is written
to cgroup.procs); the resident reference runs in a child outside. cgroup v2 is used when its
memory controller is available, else the v1 memory controller. The cgroup is always removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moed.client import TokenEvent
from tests.fixtures.checkpoints import write_large_checkpoint
from tests.fixtures.daemon_harness import start_daemon

pytestmark = [
    pytest.mark.serial,
    pytest.mark.process,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux cgroups"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a cgroup"),
]

MAX_TOKENS = 12

CHILD = r"""
import json, sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

path, mode, budget = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
streamer = None
if mode == "resident":
    model, _ = load_model(path)
else:
    from moed.daemon.experts import StreamingConfig, install_streaming
    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(model, path, StreamingConfig(cache_budget=budget))
    mx.eval(model.parameters())
prompt = mx.array([(13 * i + 7) % 300 + 3 for i in range(64)])
tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=MAX_TOKENS)]
status = Path("/proc/self/status").read_text()
hwm = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({"tokens": tokens, "hwm": hwm,
                  "snapshot": streamer.snapshot() if streamer else None,
                  "plan": streamer.plan.describe() if streamer else ""}))
""".replace("MAX_TOKENS", str(MAX_TOKENS))


def _child(path: Path, mode: str, budget: str = "", preexec=None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), mode, budget],
        capture_output=True,
        text=True,
        preexec_fn=preexec,
        timeout=600,
    )
    assert proc.returncode == 0, f"{mode} child failed ({proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_streaming_fits_under_a_cgroup_limit_of_60_percent(tmp_path_factory, memory_cgroup):
    path = write_large_checkpoint(tmp_path_factory.mktemp("large") / "qwen3_moe-300mb", 300)
    size = sum(f.stat().st_size for f in path.glob("model*.safetensors"))
    limit = int(0.6 * size)

    resident = _child(path, "resident")
    assert resident["hwm"] > limit  # the resident model could not run under this limit

    cgroup = memory_cgroup(limit)
    streamed = _child(path, "stream", "auto", preexec=cgroup.enter)
    peak, kills = cgroup.peak_bytes(), cgroup.oom_kills()
    cgroup.destroy()
    assert not cgroup.path.exists()

    assert streamed["tokens"] == resident["tokens"]
    snap = streamed["snapshot"]
    assert snap["page_cache_bypass"] is True  # auto: the experts exceed half of the cgroup's memory
    assert 0 < snap["budget_bytes"] < limit and snap["misses"] > 0
    assert kills == 0
    assert streamed["hwm"] < limit, streamed["plan"]
    if peak is not None:
        assert peak <= limit


def test_the_daemon_serves_under_a_cgroup_limit_of_60_percent(
    tmp_path_factory, tmp_path, memory_cgroup
):
    """The same, through the real daemon and client: `moed serve` placed in the cgroup, auto
    budget."""
    # 400 MB, not 300: the daemon's own baseline (about 105 MB of Python, MLX, ZeroMQ) left 300 MB's
    # 60% only 0.6 MB above the smallest plan, and a run's baseline varies by more.
    path = write_large_checkpoint(tmp_path_factory.mktemp("large-d") / "qwen3_moe-400mb", 400)
    size = sum(f.stat().st_size for f in path.glob("model*.safetensors"))
    limit = int(0.6 * size)
    resident = _child(path, "resident")

    cgroup = memory_cgroup(limit)
    daemon = None
    try:
        # A short planned context: the default 8192-token KV reservation alone would not fit this
        # limit.
        daemon = start_daemon(
            tmp_path, path, env={"MOED_PLAN_CONTEXT_TOKENS": "512"}, preexec_fn=cgroup.enter
        )
        prompt = [(13 * i + 7) % 300 + 3 for i in range(64)]
        with daemon.client(timeout=60) as c:
            tokens = [
                t
                for e in c.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS)
                if isinstance(e, TokenEvent)
                for t in e.ids
            ]
            status = c.status()
        assert daemon.stop() == 0
        peak, kills = cgroup.peak_bytes(), cgroup.oom_kills()
    finally:
        if daemon is not None:
            daemon.stop()
        cgroup.destroy()
    assert not cgroup.path.exists()
    # The daemon stops at EOS where the reference (raw generate_step) runs on: compare that prefix.
    assert tokens == resident["tokens"][: len(tokens)]
    assert (
        len(tokens) == MAX_TOKENS or resident["tokens"][len(tokens)] == 2
    )  # 2: the fixture tokenizer's EOS
    assert status["streaming"]["misses"] > 0 and status["streaming"]["budget_bytes"] < limit
    assert kills == 0
    if peak is not None:
        assert peak <= limit
