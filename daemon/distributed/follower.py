"""Ranks above 0: follow rank 0's steps until it says stop (or the group breaks)."""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from moed.daemon.distributed.cache_ops import MirroredCaches
from moed.daemon.distributed.control import RankControl
from moed.daemon.distributed.guard import GuardRefused, join
from moed.daemon.distributed.hostfile import Backend
from moed.daemon.distributed.protocol import ProtocolMismatch, StepChannel, StepOp
from moed.daemon.distributed.rank_disk import FollowerDisk, rank_disk_place
from moed.daemon.distributed.rank_model import (
    PipelineUnsupported,
    RankModel,
    load_rank_model,
    num_layers,
)
from moed.daemon.distributed.rank_status import rank_status
from moed.daemon.distributed.ring_handoff import init_ring
from moed.daemon.distributed.ring_links import LinkListeners, RingLinks, form_links
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.model.layer_caches import trimmable_layers
from moed.daemon.model.loader import MemoryPlanRefused
from moed.protocol.paths import default_socket_path

log = logging.getLogger("moed.distributed")


def follow(rank: RankModel, channel: StepChannel, disk: FollowerDisk | None = None) -> int:
    """Run every step rank 0 broadcasts; returns the number of steps run."""
    caches = MirroredCaches(lambda: make_prompt_cache(rank.model), disk)
    while True:
        step = channel.receive()
        caches.apply(step.ops)  # rank 0's batch changes since the last step, in its order
        if step.op is StepOp.FORWARD:
            if len(step.handles) != 1:
                raise ProtocolMismatch(f"a forward names {len(step.handles)} caches, not one")
            # The PipelineMixin module alone: the last norm, no lm_head (rank 0 samples).
            out = rank.pipeline(mx.array(step.tokens), cache=caches.get(step.handles[0]))
            mx.eval(out)
        elif step.op is StepOp.STATUS:
            link = {"steps": channel.counters.steps}
            disk_status = disk.snapshot() if disk is not None else None
            channel.gather_json(rank_status(rank, link, len(caches), disk_status))
        elif step.op is StepOp.PREFIX_LOAD:
            channel.gather_json({"ok": caches.take_load_result()})
        elif step.op is StepOp.SHED:
            if rank.streamer is not None:
                rank.streamer.shed(step.arg / 1000.0)
            mx.clear_cache()
        elif step.op is StepOp.SHUTDOWN:
            log.info("rank %d: rank 0 ended the group after %d steps", channel.rank, step.seq)
            return channel.counters.steps


def join_ring(spec, rank: int, secret: bytes) -> RingLinks | None:
    """Pass rank 0's guard (saying where this rank's ring ports listen) and, on the ring backend,
    make this rank's proved links to its neighbours (ring_links.py)."""
    host, port = spec.guard.rsplit(":", 1)
    listeners = LinkListeners(tuple(spec.rank_ips[rank]))
    try:
        ring = join((host, int(port)), rank, listeners.addresses, secret)
        if spec.backend != Backend.RING.value:
            return None
        return form_links(rank, ring, listeners, secret)
    finally:
        listeners.close()


def _init_group(spec, rank: int, links: RingLinks | None):
    """mx.distributed.init: on the ring, over the proved links (ring_handoff.py)."""
    import shutil
    import tempfile

    if links is None:
        return mx.distributed.init(backend=spec.backend, strict=True)
    folder = tempfile.mkdtemp(prefix="moed-rank-")
    try:
        return init_ring(links, rank, len(spec.rank_ips), folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_follower(spec, expected_rank: int, secret: bytes, heartbeat=None) -> int:
    """A follower process: join the group, load this rank's layers, follow until told to stop."""
    import faulthandler
    from pathlib import Path

    faulthandler.enable(all_threads=True)  # an abort leaves its threads' stacks in stderr
    try:
        links = join_ring(spec, expected_rank, secret)
    except (OSError, ValueError, GuardRefused) as exc:  # rank 0 fails the group and restarts it
        log.error("rank %d could not join rank 0 at %s: %s", expected_rank, spec.guard, exc)
        return DaemonExit.FAILED
    if heartbeat is not None:
        heartbeat.hold()  # init keeps the GIL while the ring connects: no beats until it is done
    try:
        group = _init_group(spec, expected_rank, links)
    finally:
        if heartbeat is not None:
            heartbeat.resume()
    if group.rank() != expected_rank:
        log.error("MLX_RANK says %d, rank 0 started rank %d", group.rank(), expected_rank)
        return DaemonExit.CONFIG
    path = Path(spec.model_path)
    try:
        split = spec.split_for(group.size(), num_layers(path))
        rank = load_rank_model(path, group, split, spec.streaming(group.rank()))
    except PipelineUnsupported as exc:
        log.error("%s", exc)
        return DaemonExit.CONFIG
    except MemoryPlanRefused as exc:
        log.error("%s", exc)
        return DaemonExit.DOES_NOT_FIT
    channel = StepChannel(group)
    control = None
    if spec.control and spec.control[group.rank()]:
        control = _start_control(rank, channel)
    disk = _open_disk(spec, rank, path)
    try:
        follow(rank, channel, disk)
    except (RuntimeError, ProtocolMismatch) as exc:  # the ring lost a peer: rank 0 restarts us
        log.error("rank %d leaves the group: %s", group.rank(), exc)
        return DaemonExit.FAILED
    finally:
        if disk is not None:
            disk.close()
        if control is not None:
            control.close()
        if rank.streamer is not None:
            rank.streamer.close()
    return DaemonExit.OK


def _open_disk(spec, rank: RankModel, path) -> FollowerDisk | None:
    """This rank's SSD files of its layers, when rank 0 keeps an SSD tier."""
    if not spec.prefix_disk_bytes or not spec.prefix_disk_dir:
        return None
    folder, fingerprint = rank_disk_place(spec.prefix_disk_dir, path, rank)
    trimmable = trimmable_layers(make_prompt_cache(rank.model))
    budget = int(spec.prefix_disk_bytes * rank.layers.share)
    return FollowerDisk(folder, budget, fingerprint, trimmable)


def _start_control(rank: RankModel, channel: StepChannel):
    """This host's moed socket, for its watchdog (shed, status, leave the group)."""
    import os

    def leave(reason: str) -> None:
        # The main thread may sit in a collective: leave at once; rank 0 restarts the group.
        log.error("rank %d leaves the group: %s", channel.rank, reason)
        control.socket_path.unlink(missing_ok=True)
        os._exit(DaemonExit.FAILED)

    def shed(fraction: float) -> int:
        return rank.streamer.shed(fraction) if rank.streamer is not None else 0

    control = RankControl(
        default_socket_path(),
        channel.rank,
        lambda: rank_status(rank, {"steps": channel.counters.steps}),
        shed,
        leave,
    )
    try:
        control.start()
    except OSError as exc:  # advisory: the rank serves its group without a local watchdog
        log.warning("rank %d: no control socket for a watchdog (%s)", channel.rank, exc)
        return None
    return control
