"""The group of ranks: mlx.launch's hostfile format (plus moed's per-host extras), or N local ranks.

A hostfile is what `mlx.launch --hostfile` reads: a list of hosts, or a map with `backend`, `envs`
and `hosts`. Each host has `ssh` (where to start it) and `ips` (where the ring backend listens);
JACCL hosts list `rdma` devices. moed adds two optional keys per host: `expert_budget` (that
host's expert cache budget) and `layers` (how many decoder layers it runs). Host 0 is rank 0: the
daemon that owns the socket and the scheduler; it runs the *last* layers (mlx-lm's PipelineMixin
hands the first layers to the highest rank).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOCAL_NAMES = frozenset({"", "localhost", LOOPBACK})


class Backend(str, enum.Enum):
    RING = "ring"  # TCP sockets, any network (Ethernet, Thunderbolt bridge, loopback)
    JACCL = "jaccl"  # RDMA over Thunderbolt 5 (macOS 26.2+)


class HostfileError(ValueError):
    """A hostfile that cannot describe a group; the message names the host and the key."""


@dataclass(frozen=True)
class RankHost:
    rank: int
    ssh: str  # where the rank is started ("" or localhost: this machine)
    ips: tuple[str, ...]  # where its ring backend listens
    rdma: tuple[str | None, ...] = ()
    expert_budget: str | None = None  # this host's cache budget (else the daemon's)
    layers: int | None = None  # decoder layers on this host (else the split decides)

    @property
    def is_local(self) -> bool:
        return self.ssh in LOCAL_NAMES


@dataclass(frozen=True)
class GroupSpec:
    hosts: tuple[RankHost, ...]
    backend: Backend = Backend.RING
    envs: tuple[str, ...] = ()
    port: int = 32323  # first ring port; one more per host and IP, as mlx.launch assigns them

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def given_split(self) -> tuple[int, ...] | None:
        """Layers per rank when every host names its count, else None (the split decides)."""
        counts = [h.layers for h in self.hosts]
        if all(c is None for c in counts):
            return None
        if any(c is None for c in counts):
            missing = [h.ssh or h.rank for h in self.hosts if h.layers is None]
            raise HostfileError(f"`layers` is set for some hosts but not for {missing}")
        return tuple(int(c) for c in counts)  # type: ignore[arg-type]

    @property
    def guard_address(self) -> tuple[str, int]:
        """Where rank 0's guard listens (distributed/guard.py): host 0's first address, `port`."""
        return (self.hosts[0].ips[0], self.port)

    def rank_files(self) -> dict[str, str]:
        """Environment variable -> file content every rank needs (mlx.launch writes the same).
        The ring's MLX_HOSTFILE is not here: only ranks that pass the guard learn its ports."""
        if self.backend is Backend.JACCL:
            return {"MLX_IBV_DEVICES": json.dumps([list(h.rdma) for h in self.hosts])}
        return {}

    def rank_env(self) -> dict[str, str]:
        env = dict(e.split("=", 1) for e in self.envs if "=" in e)
        if self.backend is Backend.JACCL:  # the guard has `port`: the coordinator the next one
            env["MLX_JACCL_COORDINATOR"] = f"{self.hosts[0].ips[0]}:{self.port + 1}"
        return env


def local_group(size: int, port: int) -> GroupSpec:
    """`--pipeline N`: N ranks on this machine over the ring backend on loopback."""
    if size < 2:
        raise HostfileError(f"a pipeline needs at least 2 ranks, not {size}")
    hosts = tuple(RankHost(r, LOOPBACK, (LOOPBACK,)) for r in range(size))
    return GroupSpec(hosts, Backend.RING, (), port)


def load_hostfile(path: Path, port: int = 32323) -> GroupSpec:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HostfileError(f"hostfile {path}: {exc}") from None
    return parse_hostfile(data, port, str(path))


def parse_hostfile(data, port: int = 32323, where: str = "hostfile") -> GroupSpec:
    backend, envs, hosts = Backend.RING.value, [], data
    if isinstance(data, dict):
        backend = data.get("backend") or backend
        envs = data.get("envs", [])
        hosts = data.get("hosts")
    if not isinstance(hosts, list) or len(hosts) < 2:
        raise HostfileError(f"{where}: `hosts` must list at least 2 hosts")
    if backend not in {b.value for b in Backend}:
        raise HostfileError(
            f"{where}: backend {backend!r} is not one of {[b.value for b in Backend]}"
        )
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
        raise HostfileError(f"{where}: `envs` must be a list of NAME=value strings")
    parsed = tuple(_host(i, h, where) for i, h in enumerate(hosts))
    group = GroupSpec(parsed, Backend(backend), tuple(envs), port)
    _ = group.given_split  # all or none of the hosts give `layers`
    if group.backend is Backend.RING and any(not h.ips for h in parsed):
        raise HostfileError(f"{where}: the ring backend needs `ips` for every host")
    if not parsed[0].ips:  # rank 0's guard (and JACCL's coordinator) listen there
        raise HostfileError(f"{where}: host 0 needs `ips` (where rank 0's guard listens)")
    if group.backend is Backend.JACCL and any(len(h.rdma) != len(parsed) for h in parsed):
        raise HostfileError(f"{where}: JACCL needs one `rdma` entry per host on every host")
    return group


def _host(rank: int, h, where: str) -> RankHost:
    if not isinstance(h, dict) or not isinstance(h.get("ssh"), str):
        raise HostfileError(f"{where}: host {rank} needs an `ssh` name")
    ips = h.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise HostfileError(f"{where}: host {h['ssh']}: `ips` must be a list of addresses")
    layers = h.get("layers")
    if layers is not None and (
        not isinstance(layers, int) or isinstance(layers, bool) or layers < 1
    ):
        raise HostfileError(f"{where}: host {h['ssh']}: `layers` must be a positive integer")
    budget = h.get("expert_budget")
    if budget is not None and not isinstance(budget, (str, int, float)):
        raise HostfileError(f"{where}: host {h['ssh']}: `expert_budget` must be a size or a %")
    return RankHost(
        rank,
        h["ssh"],
        tuple(ips),
        tuple(h.get("rdma") or ()),
        None if budget is None else str(budget),
        layers,
    )
