"""`moed bench replica OUT [--layers N]`: a full-scale stand-in for a published MoE checkpoint.

The checkpoint has the exact layout of `mlx-community/Qwen3.6-35B-A3B-4bit` (published_models.py:
its config.json, every tensor name, shape and dtype mlx-lm loads, the vision tower it carries,
~5 GiB shards with their index), random weights in place of trained ones
(replica_values.py), and a tokenizer with the real vocabulary size, control-token ids and chat
template (replica_tokenizer.py). `--layers N` keeps the first N layers of the same model. It
loads in plain `mlx_lm.load` and in `moed serve`; tokens are meaningless, their identity between
streaming and resident is what it is for, and its timings are the target's.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from moed.daemon.bench.published_models import PublishedModel, ReplicaConfigError, shallower
from moed.daemon.bench.replica_layout import (
    EXPERT_TENSOR,
    Dtype,
    Fill,
    TensorSpec,
    replica_tensors,
)
from moed.daemon.bench.replica_tokenizer import write_tokenizer
from moed.daemon.bench.replica_values import values
from moed.daemon.bench.shard_writer import (
    SHARD_BYTES,
    Shard,
    plan_shards,
    write_index,
    write_shard,
)
from moed.protocol.units import format_bytes


@dataclass(frozen=True)
class ReplicaReport:
    path: Path
    layers: int
    shards: int
    tensors: int
    total_bytes: int
    expert_bytes: int  # the stacked routed experts (what streams)
    seconds: float

    def describe(self) -> str:
        rate = self.total_bytes / self.seconds / 1e9 if self.seconds else 0.0
        return (
            f"wrote {self.path}: {self.layers} layers, {self.tensors} tensors in {self.shards} "
            f"shard(s), {format_bytes(self.total_bytes)} ({format_bytes(self.expert_bytes)} of "
            f"routed experts) in {self.seconds:.1f} s ({rate:.2f} GB/s)"
        )


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Spawned workers import the parent's main script by its path; a `moed` wrapper script
    without a `__main__` guard (a venv-less host's) would run the whole command again in each."""
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is not None or not hasattr(main, "__file__"):
        yield  # `python -m` or `-c`: the workers import nothing of the parent's script
        return
    path = main.__dict__.pop("__file__")
    try:
        yield
    finally:
        main.__file__ = path


def write_replica(
    dest: Path,
    config: dict[str, Any],
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    progress: Any = None,
    floats: Dtype = Dtype.BF16,
    workers: int | None = None,
) -> ReplicaReport:
    """Write the checkpoint `config` describes into `dest` (created; files of an earlier replica
    there are replaced). `progress(n)` after every n bytes of weights; `workers` processes write
    shards side by side (None: half the cores, at most one per shard)."""
    t0 = time.perf_counter()
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("model*.safetensors"):  # a deeper replica's shards would stay listed
        old.unlink()
    specs = replica_tensors(config, floats)
    shards = plan_shards(specs, shard_bytes)
    tick = progress or (lambda n: None)
    if workers is None:
        workers = max(1, (os.cpu_count() or 1) // 2)
    workers = min(len(shards), workers)
    if workers > 1:  # shards are independent: one process each, on a host with cores to spare
        context = multiprocessing.get_context("spawn")  # a fork would copy MLX's threads
        with _main_not_rerun(), ProcessPoolExecutor(workers, mp_context=context) as pool:
            jobs = {pool.submit(_write_one, dest / sh.name, sh, seed): sh for sh in shards}
            for done in as_completed(jobs):
                done.result()
                tick(jobs[done].nbytes)
    else:
        for shard in shards:
            write_shard(dest / shard.name, shard, lambda s, a, n: values(s, seed, a, n), tick)
    write_index(dest, shards, _parameters(specs))
    if floats is not Dtype.BF16:  # what the weights are, as a conversion says it
        config = {**config, "text_config": {**config["text_config"], "dtype": "float32"}}
    (dest / "config.json").write_text(json.dumps(config, indent=4))
    write_tokenizer(dest, int(config["text_config"]["vocab_size"]))
    return ReplicaReport(
        dest,
        int(config["text_config"]["num_hidden_layers"]),
        len(shards),
        len(specs),
        sum(s.nbytes for s in specs),
        sum(s.nbytes for s in specs if EXPERT_TENSOR.search(s.name)),
        time.perf_counter() - t0,
    )


def _write_one(path: Path, shard: Shard, seed: int) -> None:
    write_shard(path, shard, lambda s, a, n: values(s, seed, a, n), lambda n: None)


def _parameters(specs: list[TensorSpec]) -> int:
    """Parameters as mlx-lm counts them: a packed word holds 32/bits weights; scales and
    biases are not parameters (vision weights count one each)."""
    n = 0
    for s in specs:
        if s.fill is Fill.PACKED:
            n += math.prod(s.shape) * 32 // s.bits
        elif s.fill not in (Fill.SCALES, Fill.BIASES):
            n += math.prod(s.shape)
    return n


@click.command("replica")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--layers",
    type=int,
    default=None,
    help="Keep the first N layers (at least one full-attention layer: N >= 4); default: all 40.",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="Scales, biases and unquantized weights: bfloat16 as published; float32 for MLX's CPU "
    "backend, where bfloat16 runs several times slower (the packed 4-bit weights are the same).",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights.")
def bench_replica(out: Path, layers: int | None, dtype: str, seed: int) -> None:
    """Write a stand-in for mlx-community/Qwen3.6-35B-A3B-4bit: its exact layout (config, every
    tensor's name, shape and dtype, shards, tokenizer, chat template) with random weights."""
    published = PublishedModel.QWEN36_35B_A3B
    config = published.config()
    if layers is not None:
        try:
            config = shallower(config, layers)
        except ReplicaConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--layers") from None
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        raise click.ClickException(f"{out} is not empty and holds no checkpoint: not touched")
    floats = Dtype.BF16 if dtype == "bfloat16" else Dtype.F32
    specs_total = sum(s.nbytes for s in replica_tensors(config, floats))
    click.echo(
        f"writing a {published.repo} replica ({config['text_config']['num_hidden_layers']} "
        f"layers, {format_bytes(specs_total)}) to {out} ...",
        err=True,
    )
    with click.progressbar(length=specs_total, label="weights", file=sys.stderr) as bar:
        report = write_replica(out, config, seed, progress=bar.update, floats=floats)
    click.echo(report.describe())
