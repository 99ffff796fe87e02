"""The prefix cache under `moed serve --pipeline 2`: rank 0 decides, and every rank keeps its own
layers of each entry (distributed/cache_ops.py's EXTRACT / OWN / RESUME ops). A conversation's
later turns resume from the cache (cached_tokens > 0) with the tokens plain mlx-lm generates,
attention-only and hybrid (qwen3_next: the follower's layers are linear attention, resumed from
recurrent-state checkpoints), greedy and seeded; both ranks hold the same entries, and clearing
the cache frees them on both. Each rank keeps files of its layers on the SSD (rank_disk.py): after
a crash of the group the next turn resumes from them, and a follower's corrupt file is a miss
with the same tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlx_lm.utils import load

from moed.client import Client, DoneEvent, TokenEvent
from tests.fixtures import pipeline_worker
from tests.fixtures.daemon_harness import moe_command
from tests.fixtures.engine_driver import SYSTEM, TURNS
from tests.fixtures.pipeline_requests import rank_lists

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def converse(client: Client, turns=TURNS, **sampling) -> list[tuple[list[int], int]]:
    out = []
    for ids in turns:
        got, cached = [], None
        for event in client.generate(
            prompt_ids=ids, max_tokens=pipeline_worker.MAX_TOKENS, **sampling
        ):
            if isinstance(event, TokenEvent):
                got += event.ids
            elif isinstance(event, DoneEvent):
                cached = event.usage["cached_tokens"]
        out.append((got, cached))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_every_rank_caches_its_layers_and_hits_give_mlx_lm_tokens(
    supervisor, checkpoint_factory, arch
):
    path = checkpoint_factory(arch, num_layers=4)
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
    model, _ = load(str(path))
    greedy_expected = [
        pipeline_worker.generate(model, ids, pipeline_worker.SamplingParams()) for ids in TURNS
    ]
    seeded_expected = [
        pipeline_worker.generate(model, ids, pipeline_worker.SamplingParams(**seeded))
        for ids in TURNS
    ]
    del model

    sup = supervisor(
        path, "--pipeline", "2", "--cache-budget", "25%", "--prefill-chunk", "8",
        "--prefix-checkpoint-tokens", "8", "--prefix-cache", "64MB",
    )  # fmt: skip
    sup.wait_ready()
    with Client(sup.socket) as c:
        greedy = converse(c)
        c.prefix_cache("clear")
        sampled = converse(c, **seeded)
        listing = c.prefix_cache("list")

        assert [t for t, _ in greedy] == greedy_expected
        assert [t for t, _ in sampled] == seeded_expected
        for got in (greedy, sampled):
            cached = [n for _, n in got]
            assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached
            if arch == "qwen3_moe":  # attention layers on both ranks: the exact common prefix
                assert cached[1] == 30 and cached[2] == len(SYSTEM)
            else:  # the follower's recurrent state: the nearest checkpoint (every 8 tokens)
                assert cached[1] == 24 and cached[2] == len(SYSTEM) - 1
        snap = c.status()["prefix_cache"]
        assert snap["hits"] >= len(TURNS) - 1 and listing["entries"], (snap, listing)
        # Rank 0's live cache lists are the follower's twins, one for one.
        lists = rank_lists(c, lambda n: n[0] == n[1])
        assert lists[0] == lists[1] > 0, lists

        c.prefix_cache("clear")
        after = rank_lists(c, lambda n: n == [0, 0])
        assert after == [0, 0], after
        # A cleared cache reads the whole prompt again, with the same tokens.
        first, cached = converse(c)[0]
        assert first == greedy_expected[0] and cached == 0


def same_files(folders: list[Path], timeout_s: float = 20.0) -> set[str]:
    """The entries every rank has written (the same names in each rank's folder), once they
    agree, are not empty, and stayed so for half a second (rank 0's writer waits for quiet)."""
    deadline = time.monotonic() + timeout_s
    agreed, since = set(), time.monotonic()
    while time.monotonic() < deadline:
        names = [{f.stem for f in d.glob("*.safetensors")} for d in folders]
        now = names[0] if names[0] and all(n == names[0] for n in names) else set()
        if now != agreed:
            agreed, since = now, time.monotonic()
        elif agreed and time.monotonic() - since >= 0.5:
            return agreed
        time.sleep(0.1)
    return set()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_every_rank_resumes_its_layers_from_the_ssd_after_a_crash(
    supervisor, checkpoint_factory, arch
):
    path = checkpoint_factory(arch, num_layers=4)
    model, _ = load(str(path))
    expected = [
        pipeline_worker.generate(model, ids, pipeline_worker.SamplingParams()) for ids in TURNS
    ]
    del model
    sup = supervisor(
        path, "--pipeline", "2", "--cache-budget", "25%", "--prefill-chunk", "8",
        "--prefix-checkpoint-tokens", "8", "--prefix-cache", "64MB",
    )  # fmt: skip
    folders = [sup.state_dir / "prefix-cache" / f"rank{r}of2" for r in (0, 1)]
    first = sup.wait_ready()
    with Client(sup.socket) as c:
        assert converse(c, TURNS[:1]) == [(expected[0], 0)]
    assert same_files(folders), [list(d.iterdir()) for d in folders]
    human = subprocess.run(
        moe_command(sup.socket, "status"), capture_output=True, text=True, check=True
    ).stdout
    assert "prefix ssd" in human, human  # the follower's line says what its folder holds
    os.kill(first["pid"], signal.SIGKILL)  # a crash: only what reached the SSD is left

    second = sup.wait_ready(not_boot=first["boot_id"])
    with Client(sup.socket) as c:
        after = converse(c, TURNS[1:2])
        snap = c.status()["prefix_cache"]
    # Attention layers resume the exact common prefix, the follower's linear attention the
    # nearest checkpoint; both ranks read their part from their own files.
    assert after == [(expected[1], 30 if arch == "qwen3_moe" else 24)], after
    assert snap["disk_loads"] >= 1, snap

    # A follower's file corrupted while the group is down: a miss, the same tokens, a warning.
    names = same_files(folders)
    os.kill(second["pid"], signal.SIGKILL)
    sup.wait_ready(not_boot=second["boot_id"])  # the old group's ranks are gone
    for name in names:
        f = folders[1] / f"{name}.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    with Client(sup.socket) as c:
        assert converse(c, TURNS[1:2]) == [(expected[1], 0)]
        assert same_files(folders)  # the turn's own entry, on both ranks again
        c.prefix_cache("clear")  # every rank's files go
        deadline = time.monotonic() + 20
        while any(next(d.glob("*.safetensors"), None) for d in folders) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert not [f for d in folders for f in d.glob("*.safetensors")]
    assert "this rank cannot read" in sup.log_text()
