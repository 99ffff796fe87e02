"""Configuration: one TOML file, overridden by MOED_* environment variables, overridden by flags.

Parsed once at the edge (the CLI) into frozen dataclasses and passed down; nothing below reads the
environment for settings.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moed.daemon.experts.budget import BudgetError, CacheBudget, parse_size
from moed.daemon.experts.policies import DEFAULT_POLICY, policy_names
from moed.daemon.experts.store import PageCachePolicy
from moed.daemon.ground.faults import Faults
from moed.protocol import paths
from moed.protocol.units import parse_keep_alive

DEMO_MODEL = "demo"  # resolved to the embedded demo checkpoint


@dataclass(frozen=True)
class ServeConfig:
    model: str = DEMO_MODEL
    socket: Path = field(default_factory=paths.default_socket_path)
    state_dir: Path = field(default_factory=paths.state_dir)
    log_dir: Path = field(default_factory=paths.log_dir)
    resident: bool = False  # keep every expert in memory (plain mlx-lm path)
    # bytes ("3000000"), "12GB", a fraction of the experts ("25%", "0.25"), or "auto"
    cache_budget: CacheBudget = field(default_factory=lambda: CacheBudget.parse("auto"))
    prefetch_workers: int = 0  # 0: sized to the machine
    page_cache: PageCachePolicy = PageCachePolicy.AUTO
    prefetch_next: bool = False  # read the next layer's likely experts during this layer's compute
    lookahead: bool = False  # read the next layer's guessed experts while the disk idles; exact
    cache_policy: str = DEFAULT_POLICY  # expert eviction policy, a name in experts/policies
    # Lossy, opt-in: each token uses its K best experts instead of the model's top-k; 0: native.
    max_active_experts: int = 0
    # What the memory plan may use; 0: the machine's (RAM, cgroup, Metal working set).
    memory_limit_bytes: int = 0
    plan_context_tokens: int = 8192  # the KV cache the memory plan keeps room for
    max_prompt_tokens: int = 32768
    max_tokens_limit: int = 0  # largest max_tokens; 0: the model's context (8192 if unknown)
    default_max_tokens: int = 256
    max_pending: int = 64
    max_pending_per_client: int = 16  # one connection cannot hold every pending slot
    client_send_hwm: int = 1000  # messages queued to one client before it counts as not reading
    max_connections: int = 0  # client connections at once; 0: what the open-file limit has room for
    progress_deadline_s: float = 60.0  # work to do and no progress this long: `engine_stalled`
    max_batch: int = 8  # requests decoded together in one batch (continuous batching)
    prefill_chunk: int = 256  # prompt tokens read per step, between decode steps of the batch
    batch_window_ms: float = 0.0  # an idle engine waits this long for requests to batch together
    drain_timeout_s: float = 10.0
    telemetry_every: int = 16  # tokens between telemetry messages
    metrics_port: int = 0  # 0: no HTTP metrics endpoint
    trace_dir: str = ""  # record a router trace of every generation here when set
    debug_faults: str = ""  # fault injection for tests; empty (off) by default
    # A device out-of-memory or GPU timeout inside a step (an MLX that raises it: 0.32.0 on, see
    # ground/device_errors.py): shed and rerun the step's rows in place, keeping the model and the
    # pid; false: always the restart path. A second failure of a kind within the window restarts.
    recover_in_place: bool = True
    recovery_window_s: float = 60.0
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
    # The prefix KV cache (engine/prefix_cache/): a request that begins with a cached prefix reads
    # only the rest. Memory tier (counted in the memory plan, shed first; 0: no prefix cache) and
    # SSD tier (0: none) budgets, and the SSD tier's folder (default <state_dir>/prefix-cache).
    prefix_cache_bytes: str = "auto"  # auto: 4% of the memory plan's usable memory, at most 2 GB
    prefix_cache_disk_bytes: str = "10GB"
    prefix_cache_dir: str = ""
    # Hybrid models: tokens between recurrent-state checkpoints while a prompt is read (rounded up
    # to a multiple of prefill_chunk; a checkpoint costs the whole recurrent state, so few).
    prefix_checkpoint_tokens: int = 1024
    # Grammars (`format`, forced `tool_choice`) compile on these threads, off the engine's, each
    # request's bounded: its grammar's source in bytes and its compile time (else
    # `schema_too_complex`).
    grammar_workers: int = 2
    max_schema_bytes: int = 1024 * 1024
    grammar_timeout_s: float = 10.0
    # What the loaded models may hold together ([models], `moe load`): a size, or auto (the
    # machine's usable memory less the process's own); past it the least recently used unloads.
    models_memory_bytes: str = "auto"

    def __post_init__(self):
        if not isinstance(self.cache_budget, CacheBudget):  # built in code with the text form
            try:
                object.__setattr__(self, "cache_budget", CacheBudget.parse(self.cache_budget))
            except BudgetError as exc:
                raise ConfigError(f"setting 'cache_budget': {exc}") from None
        if self.cache_policy not in policy_names():
            raise ConfigError(
                f"setting 'cache_policy': {self.cache_policy!r} is not a cache policy "
                f"(allowed: {', '.join(policy_names())})"
            )
        if self.max_active_experts < 0:
            raise ConfigError(
                f"setting 'max_active_experts': {self.max_active_experts} is not allowed; "
                "allowed: 0 (the model's own top-k) or an integer from 1 to the model's top-k"
            )
        try:
            parse_keep_alive(self.keep_alive)
        except ValueError as exc:
            raise ConfigError(f"setting 'keep_alive': {exc}") from None

    @property
    def keep_alive_s(self) -> float | None:
        """Seconds an idle model stays loaded; None: forever."""
        return parse_keep_alive(self.keep_alive)

    @property
    def prefix_cache_folder(self) -> Path:
        """The SSD tier's folder (a pipeline's ranks each keep a folder inside it)."""
        return (
            Path(self.prefix_cache_dir)
            if self.prefix_cache_dir
            else Path(self.state_dir) / "prefix-cache"
        )

    @property
    def prefix_cache_ssd_folder(self) -> Path | None:
        """The SSD tier's folder when these settings use one (a start checks it first)."""
        off = self.prefix_cache_bytes != "auto" and parse_size(self.prefix_cache_bytes) == 0
        if off or parse_size(self.prefix_cache_disk_bytes) <= 0:
            return None
        return self.prefix_cache_folder

    @property
    def pipelined(self) -> bool:
        """This daemon is rank 0 of a pipeline group (`--pipeline N` or `--hostfile`)."""
        return bool(self.pipeline or self.hostfile)


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
class ModelEntry:
    """One `[models]` alias: a name clients use, the model it stands for, its own settings."""

    name: str
    model: str  # a folder, a Hugging Face id or demo (resolved when first asked for)
    cache_budget: CacheBudget | None = None  # None: [serve]'s
    keep_alive: str | None = None
    context: int | None = None  # the KV room its memory plan keeps (plan_context_tokens)
    pin: bool = False  # never unloaded to make room for another model
    prefix_cache_disk: str | None = None  # its SSD prefix-cache budget (a size); None: [serve]'s
    debug_faults: str = ""  # fault injection for this model's engine only (tests)


@dataclass(frozen=True)
class Config:
    serve: ServeConfig = field(default_factory=ServeConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    models: tuple[ModelEntry, ...] = ()


class ConfigError(ValueError):
    pass


_SECTIONS = {ServeConfig: "serve", WatchdogConfig: "watchdog"}


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
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"{file}: cannot be read: {exc}") from None
        unknown = set(table) - set(_SECTIONS.values()) - {"models"}
        if unknown:
            raise ConfigError(
                f"{file}: unknown section(s) {', '.join(sorted(unknown))}; "
                "allowed: serve, watchdog, models"
            )
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
    return Config(serve=serve, watchdog=watchdog, models=model_entries(table.get("models", {})))


_ENTRY_KEYS = {"path": str, "budget": CacheBudget, "keep_alive": str, "context": int}
_ENTRY_KEYS |= {"pin": bool, "debug_faults": str, "prefix_cache_disk": str}
_AS = {k: k for k in _ENTRY_KEYS} | {"prefix_cache_disk": "prefix_cache_disk_bytes"}  # checked as


def model_entries(table: Any) -> tuple[ModelEntry, ...]:
    """`[models]`: `name = "path"`, or `[models.name]` with path, budget, keep_alive, context,
    pin, prefix_cache_disk; each value checked as a [serve] setting is."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"[models] must be a table of name = path, got {table!r:.60}")
    entries = []
    for name, spec in table.items():
        spec = {"path": spec} if isinstance(spec, str) else spec
        if not isinstance(spec, Mapping) or "path" not in spec or set(spec) - set(_ENTRY_KEYS):
            raise ConfigError(
                f"[models] {name}: {spec!r:.80} is not allowed; allowed: a path, or a table "
                f"with path and any of {', '.join(sorted(set(_ENTRY_KEYS) - {'path'}))}"
            )
        where = f"[models.{name}]"
        got = {k: _checked(_AS[k], f"{where} {k}", _ENTRY_KEYS[k], v) for k, v in spec.items()}
        if got.get("keep_alive") is not None:
            try:
                parse_keep_alive(got["keep_alive"])
            except ValueError as exc:
                raise ConfigError(f"{where} keep_alive: {exc}") from None
        if got.get("context") is not None and got["context"] < 1:
            raise ConfigError(f"{where} context: {got['context']} is not allowed; allowed: >= 1")
        faults = got.pop("debug_faults", "")
        _checked("debug_faults", f"{where} debug_faults", str, faults)
        budget = got.pop("budget", None)
        entries.append(ModelEntry(name, got.pop("path"), budget, debug_faults=faults, **got))
    return tuple(entries)


def _build(
    cls: type,
    table: Mapping[str, Any],
    environ: Mapping[str, str],
    prefix: str,
    overrides: Mapping[str, Any],
):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{_SECTIONS[cls]}] must be a table of settings, got {table!r:.60}")
    unknown = set(table) - known
    if unknown:
        raise ConfigError(
            f"unknown [{_SECTIONS[cls]}] setting(s): {', '.join(sorted(unknown))} "
            f"(allowed: {', '.join(sorted(known))})"
        )
    values: dict[str, Any] = {}
    for name in known:
        raw: Any = None
        if overrides.get(name) is not None:
            raw, source = overrides[name], "flag"
        elif (env_name := prefix + name.upper()) in environ:
            raw, source = environ[env_name], env_name
        elif name in table:
            raw, source = table[name], f"[{_SECTIONS[cls]}] {name}"
        if raw is not None:
            values[name] = _checked(name, source, hints[name], raw)
    return cls(**values)


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
_INT = re.compile(r"^[+-]?\d+$")


def _checked(name: str, source: str, hint: Any, raw: Any) -> Any:
    """Coerce one setting strictly and check its range; the error names key, value and allowed."""
    allowed = RANGES.get(name, (None, _KIND.get(hint, str(hint))))[1]

    def refuse() -> ConfigError:
        return ConfigError(
            f"setting {name!r} ({source}): {raw!r} is not allowed; allowed: {allowed}"
        )

    if hint is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise refuse()
    if hint is int:
        if isinstance(raw, bool) or not (
            isinstance(raw, int) or (isinstance(raw, str) and _INT.match(raw.strip()))
        ):
            raise refuse()
        value: Any = int(raw)
    elif hint is float:
        try:
            value = float(raw) if not isinstance(raw, bool) else math.nan
        except (TypeError, ValueError):
            raise refuse() from None
        if not math.isfinite(value):
            raise refuse()
    elif hint is Path:
        if not isinstance(raw, (str, Path)) or not str(raw):
            raise refuse()
        value = Path(raw).expanduser()
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = ", ".join(m.value for m in hint)
        try:
            value = hint(raw)
        except ValueError:
            raise refuse() from None
    elif hint is CacheBudget:  # parsed here once; the memory plan resolves it to bytes
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise refuse()
        try:
            value = CacheBudget.parse(str(raw))
        except BudgetError:
            raise refuse() from None
    elif hint is str:
        # TOML may give a budget or a keep-alive as a number (cache_budget = 3000000).
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise refuse()
        value = str(raw)
    else:
        raise ConfigError(f"setting {name!r}: unsupported type {hint}")
    check = RANGES.get(name, (None, ""))[0]
    if check is not None and not _passes(check, value):
        raise refuse()
    return value


def _passes(check: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(check(value))
    except ValueError:
        return False


def _size_syntax(spec: str) -> bool:
    if spec != "auto":
        parse_size(spec)  # raises BudgetError (a ValueError)
    return True


def _faults_syntax(spec: str) -> bool:
    Faults.parse(spec)
    return True


_KIND = {int: "an integer", float: "a finite number", bool: "true or false", Path: "a path"}
# name -> (check of the coerced value, what is allowed); fields not listed only need their type.
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    # Checked as it is parsed (_checked): this is what its refusal says is allowed.
    "cache_budget": (bool, "bytes (3000000), a size (12GB, 512MiB), 25%, 0.25 or auto"),
    "prefix_cache_bytes": (_size_syntax, "auto, a size (1GB, 512MiB, bytes), 0 for none"),
    "models_memory_bytes": (_size_syntax, "auto, or a size (12GB, 512MiB, bytes)"),
    "prefix_cache_disk_bytes": (_size_syntax, "a size (10GB, 512MiB, bytes), 0 for no SSD tier"),
    "prefix_checkpoint_tokens": (lambda v: v >= 1, "an integer >= 1 (tokens)"),
    "grammar_workers": (lambda v: 1 <= v <= 64, "an integer in [1, 64]"),
    "max_schema_bytes": (lambda v: v >= 1024, "an integer >= 1024 (bytes)"),
    "grammar_timeout_s": (lambda v: v > 0, "a number of seconds > 0"),
    "prefetch_workers": (
        lambda v: 0 <= v <= 256,
        "an integer in [0, 256] (0: sized to the machine)",
    ),
    "memory_limit_bytes": (lambda v: v >= 0, "an integer >= 0 (0: the machine's)"),
    "plan_context_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "max_prompt_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "max_tokens_limit": (lambda v: v >= 0, "an integer >= 0 (0: the model's context)"),
    "default_max_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "max_pending": (lambda v: v >= 1, "an integer >= 1"),
    "max_pending_per_client": (lambda v: v >= 1, "an integer >= 1"),
    "client_send_hwm": (lambda v: 16 <= v <= 1_000_000, "an integer in [16, 1000000]"),
    "max_connections": (lambda v: v >= 0, "an integer >= 0 (0: sized to the open-file limit)"),
    "progress_deadline_s": (lambda v: v > 0, "a number of seconds > 0"),
    "drain_timeout_s": (lambda v: v >= 0, "a number of seconds >= 0"),
    "telemetry_every": (lambda v: v >= 1, "an integer >= 1 (tokens between telemetry messages)"),
    "metrics_port": (lambda v: 0 <= v <= 65535, "a TCP port in [1, 65535], or 0 for none"),
    "debug_faults": (
        _faults_syntax,
        "empty, or oom_after=N, abort_after=N, hang_after=N, step_error_after=N, "
        "layer_hang_after=N, layer_delay_ms=N, layer_gil_ms=N, step_delay_ms=N, "
        "text_<stage>_after=N, <message>_at_<point>=N (ground/faults.py)",
    ),
    "recovery_window_s": (
        lambda v: v >= 0,
        "a number of seconds >= 0 (0: only a failure during a recovery restarts)",
    ),
    "restart_budget": (lambda v: v >= 0, "an integer >= 0 (0: never stop restarting)"),
    "restart_window_s": (lambda v: v > 0, "a number of seconds > 0"),
    "interval_s": (lambda v: v > 0, "a number of seconds > 0"),
    "consecutive": (lambda v: v >= 1, "an integer >= 1"),
    "swap_growth_mb": (lambda v: v > 0, "a number of MB > 0"),
    "progress_timeout_s": (lambda v: v > 0, "a number of seconds > 0"),
    "step_grace_s": (lambda v: v >= 0, "a number of seconds >= 0"),
    "recover_s": (lambda v: v >= 0, "a number of seconds >= 0"),
    "model": (lambda v: bool(v.strip()), "a model folder, a Hugging Face id or demo"),
    "pipeline": (lambda v: 0 <= v <= 64, "an integer in [0, 64] (0: one process)"),
    "pipeline_port": (lambda v: 0 <= v <= 65535, "a TCP port in [1, 65535], or 0 for free ports"),
    "rank_timeout_s": (lambda v: v > 0, "a number of seconds > 0"),
}


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
