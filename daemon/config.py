"""Configuration: one TOML file, overridden by MOED_* environment variables, overridden by flags.

Parsed once at the edge (the CLI) into frozen dataclasses and passed down; nothing below reads the
environment for settings.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moed.daemon.experts.policies import DEFAULT_POLICY, policy_names
from moed.protocol import paths
from moed.protocol.units import parse_keep_alive

DEMO_MODEL = "demo"  # resolved to the embedded demo checkpoint


class PageCachePolicy(str, enum.Enum):
    AUTO = "auto"  # bypass when the experts are much larger than RAM, trust otherwise
    BYPASS = "bypass"  # F_NOCACHE on macOS, POSIX_FADV_DONTNEED / O_DIRECT on Linux
    TRUST = "trust"


@dataclass(frozen=True)
class ServeConfig:
    model: str = DEMO_MODEL
    socket: Path = field(default_factory=paths.default_socket_path)
    state_dir: Path = field(default_factory=paths.state_dir)
    log_dir: Path = field(default_factory=paths.log_dir)
    resident: bool = False  # keep every expert in memory (plain mlx-lm path)
    cache_budget: str = (
        "auto"  # bytes ("3000000"), "12GB", a fraction of the experts ("25%", "0.25"), or "auto"
    )
    prefetch_workers: int = 0  # 0: sized to the machine
    page_cache: PageCachePolicy = PageCachePolicy.AUTO
    prefetch_next: bool = False  # read the next layer's likely experts during this layer's compute
    cache_policy: str = DEFAULT_POLICY  # expert eviction policy, a name in experts/policies
    memory_limit_bytes: int = (
        0  # what the memory plan may use; 0: the machine's (RAM, cgroup, Metal working set)
    )
    plan_context_tokens: int = 8192  # the KV cache the memory plan keeps room for
    max_prompt_tokens: int = 32768
    max_tokens_limit: int = 8192
    default_max_tokens: int = 256
    max_pending: int = 64
    drain_timeout_s: float = 10.0
    telemetry_every: int = 16  # tokens between telemetry messages
    metrics_port: int = 0  # 0: no HTTP metrics endpoint
    trace_dir: str = ""  # record a router trace of every generation here when set
    debug_faults: str = ""  # fault injection for tests; empty (off) by default
    restart_budget: int = 5  # crashes ...
    restart_window_s: float = 600.0  # ... within this window stop the restart loop
    # A pipeline over several ranks (mx.distributed): N local ranks, or a hostfile's hosts.
    pipeline: int = 0  # local ranks over the ring backend on loopback; 0: one process
    hostfile: str = ""  # mlx.launch's hostfile (+ per-host expert_budget and layers)
    pipeline_split: str = "even"  # even, cost, or layers per rank like "20,20" (rank 0 first)
    pipeline_port: int = 0  # first ring port; 0: free local ports (hostfiles: 32323)
    rank_timeout_s: float = 2.0  # a rank silent this long has stalled: the group restarts
    # Unload the model and its expert cache after this idle time (ollama's keep_alive): a duration
    # (30s, 5m, 1h), -1 never, 0 as soon as idle. The next request reloads it.
    keep_alive: str = "5m"

    def __post_init__(self):
        if self.cache_policy not in policy_names():
            raise ConfigError(
                f"setting 'cache_policy': {self.cache_policy!r} is not a cache policy "
                f"(allowed: {', '.join(policy_names())})"
            )
        try:
            parse_keep_alive(self.keep_alive)
        except ValueError as exc:
            raise ConfigError(f"setting 'keep_alive': {exc}") from None

    @property
    def keep_alive_s(self) -> float | None:
        """Seconds an idle model stays loaded; None: forever."""
        return parse_keep_alive(self.keep_alive)


@dataclass(frozen=True)
class WatchdogConfig:
    socket: Path = field(default_factory=paths.default_socket_path)
    state_dir: Path = field(default_factory=paths.state_dir)
    interval_s: float = 1.0
    consecutive: int = 3  # bad samples in a row before acting
    swap_growth_mb: float = 512.0  # swap growth over the baseline that counts as bad
    progress_timeout_s: float = 120.0  # busy with no token for this long: wedged
    step_grace_s: float = 5.0  # wait between escalation steps
    recover_s: float = 60.0  # no bad sample for this long after a step: the ladder starts over
    event_log: str = ""  # default: <state_dir>/watchdog.jsonl


@dataclass(frozen=True)
class Config:
    serve: ServeConfig = field(default_factory=ServeConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)


class ConfigError(ValueError):
    pass


def load_config(
    file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    serve_overrides: Mapping[str, Any] | None = None,
    watchdog_overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge file < environment < flags. Flags given as None are ignored."""
    environ = os.environ if environ is None else environ
    file = file or (
        Path(environ["MOED_CONFIG"]) if environ.get("MOED_CONFIG") else paths.config_path()
    )
    table: dict = {}
    if file.exists():
        try:
            table = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: {exc}") from None
    serve = _build(ServeConfig, table.get("serve", {}), environ, "MOED_", serve_overrides or {})
    watchdog = _build(
        WatchdogConfig,
        table.get("watchdog", {}),
        environ,
        "MOED_WATCHDOG_",
        watchdog_overrides or {},
    )
    # One socket for both processes unless the watchdog's was set on its own.
    if (
        "socket" not in table.get("watchdog", {})
        and "MOED_WATCHDOG_SOCKET" not in environ
        and not (watchdog_overrides or {}).get("socket")
    ):
        watchdog = dataclasses.replace(watchdog, socket=serve.socket, state_dir=serve.state_dir)
    return Config(serve=serve, watchdog=watchdog)


def _build(
    cls: type,
    table: Mapping[str, Any],
    environ: Mapping[str, str],
    prefix: str,
    overrides: Mapping[str, Any],
):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} setting(s): {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    for name in known:
        raw: Any = None
        if overrides.get(name) is not None:
            raw = overrides[name]
        elif (env_name := prefix + name.upper()) in environ:
            raw = environ[env_name]
        elif name in table:
            raw = table[name]
        if raw is not None:
            values[name] = _coerce(name, hints[name], raw)
    return cls(**values)


def _coerce(name: str, hint: Any, raw: Any) -> Any:
    try:
        if hint is bool:
            if isinstance(raw, str):
                return raw.strip().lower() in {"1", "true", "yes", "on"}
            return bool(raw)
        if hint is Path:
            return Path(raw).expanduser()
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return hint(raw)
        if hint in (int, float, str):
            return hint(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"setting {name!r}: cannot use {raw!r} ({exc})") from None
    if isinstance(hint, types.UnionType):
        return raw
    raise ConfigError(f"setting {name!r}: unsupported type {hint}")


def to_toml(config: Config) -> str:
    """Render a config as TOML (used by `moed service install` for the first config file)."""
    lines: list[str] = []
    for section, obj in (("serve", config.serve), ("watchdog", config.watchdog)):
        lines.append(f"[{section}]")
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            if isinstance(value, bool):
                lines.append(f"{f.name} = {'true' if value else 'false'}")
            elif isinstance(value, (int, float)):
                lines.append(f"{f.name} = {value}")
            else:
                text = str(value).replace("\\", "\\\\").replace('"', '\\"')
                lines.append(f'{f.name} = "{text}"')
        lines.append("")
    return "\n".join(lines)
