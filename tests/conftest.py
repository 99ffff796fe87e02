"""Shared pytest fixtures. Helpers first; append new fixtures below, one block per concern."""

from __future__ import annotations

import inspect
import os
import pwd
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.fixtures.checkpoints import write_checkpoint

# --- markers: a test that starts a daemon says so ------------------------------------------

# make test-fast leaves out `process` tests; one that asks for a daemon (or the service stand-ins)
# without saying so would slip into the edit loop (and its two minutes).
PROCESS_FIXTURES = frozenset(
    {"daemon", "daemon_factory", "supervisor", "gateway_stack", "fake_tools"}
)


def pytest_collection_modifyitems(config, items):
    unmarked = [
        item.nodeid
        for item in items
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("process") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests start processes through a fixture but are not marked `process`: "
            + ", ".join(unmarked)
        )


# --- isolation from the user's own moed ------------------------------------------------------


@pytest.fixture(autouse=True, scope="session")
def _private_moed_dirs(tmp_path_factory):
    """Every daemon and client a test starts uses session-private state, log, config and socket
    paths, so the suite never writes into (or reads) the user's ~/.local/state/moed or talks to
    their daemon, and two workers (a session each) never share a default socket."""
    root = tmp_path_factory.mktemp("moed-home")
    private = {
        "MOED_STATE_DIR": root / "state",
        "MOED_LOG_DIR": root / "logs",
        "MOED_CONFIG": root / "config.toml",
        "MOED_RUNTIME_DIR": root / "run",
    }
    saved = {name: os.environ.get(name) for name in private}
    os.environ.update({name: str(path) for name, path in private.items()})
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    # The short socket folders under /tmp (daemon_harness.short_socket_path) go with the session.
    for folder in Path("/tmp").glob(f"moedt-{os.getpid()}-*"):
        shutil.rmtree(folder, ignore_errors=True)


# --- tiny MoE checkpoints -------------------------------------------------------------------


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """`checkpoint_factory(arch, **write_checkpoint_kwargs) -> Path`, written once per session.

    Checkpoints are cached by their arguments, so tests asking for the same model share one
    directory: treat it as read-only.
    """
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("checkpoints")
    defaults = {
        k: p.default
        for k, p in inspect.signature(write_checkpoint).parameters.items()
        if p.default is not inspect.Parameter.empty
    }

    def make(arch: str = "qwen3_moe", **kwargs) -> Path:
        # Key on the non-default arguments, so bits=None and no bits share one checkpoint.
        given = {k: v for k, v in sorted(kwargs.items()) if defaults.get(k, object()) != v}
        key = (arch, *given.items())
        if key not in cache:
            name = "-".join([arch, *(f"{k}{v}" for k, v in given.items())])
            cache[key] = write_checkpoint(root / name, arch, **given)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(checkpoint_factory) -> Path:
    """A float32 qwen3_moe checkpoint: 2 MoE layers, 8 experts, top-2, hidden 64."""
    return checkpoint_factory("qwen3_moe")


# --- real daemon processes ------------------------------------------------------------------

from tests.fixtures.daemon_harness import DaemonProcess, Supervisor, start_daemon  # noqa: E402


@pytest.fixture
def daemon_factory(tmp_path):
    """`daemon_factory(model, *serve_args, env=None, wait=True) -> DaemonProcess`; all stopped at
    teardown."""
    started: list[DaemonProcess] = []

    def make(model, *extra, env=None, wait=True) -> DaemonProcess:
        d = start_daemon(tmp_path / f"d{len(started)}", model, *extra, env=env, wait=wait)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()  # also removes its socket directory


@pytest.fixture
def daemon(daemon_factory, tiny_model) -> DaemonProcess:
    """A running resident daemon on the tiny qwen3_moe checkpoint."""
    return daemon_factory(tiny_model, "--resident")


@pytest.fixture
def supervisor(tmp_path):
    """`supervisor(model, *serve_args, env=None) -> Supervisor`: `moed serve` restarted like
    KeepAlive restarts it; all stopped at teardown."""
    made: list[Supervisor] = []

    def make(model: Path, *serve_args: str, env: dict | None = None) -> Supervisor:
        sup = Supervisor(tmp_path / f"s{len(made)}", model, *serve_args, env=env)
        sup.tmp.mkdir(parents=True)
        made.append(sup)
        return sup.start()

    try:
        yield make
    finally:
        for sup in made:
            sup.stop()


# --- memory cgroups (root-only Linux tests) ---------------------------------------------------

from tests.fixtures.cgroups import MemoryCgroup  # noqa: E402


@pytest.fixture
def memory_cgroup():
    """`memory_cgroup(limit_bytes, swap=False) -> MemoryCgroup`; all removed at teardown. Skips
    where the machine has no memory cgroup we may write (a container may show one read-only)."""
    made: list[MemoryCgroup] = []

    def make(limit_bytes: int, swap: bool = False) -> MemoryCgroup:
        try:
            cg = MemoryCgroup(limit_bytes, swap=swap)
        except OSError as exc:
            pytest.skip(f"cannot create a memory cgroup here: {exc}")
        made.append(cg)
        return cg

    try:
        yield make
    finally:
        for cg in made:
            cg.destroy()


# --- the HTTP gateway in front of a real daemon ----------------------------------------------

from tests.fixtures.gateway_harness import GatewayProcess, start_gateway  # noqa: E402


@pytest.fixture(scope="module")
def gateway_stack(tmp_path_factory, tiny_model):
    """(daemon, gateway): one resident daemon on the tiny checkpoint and a `moed gateway` in front
    of it, shared by a test module (starting them costs seconds)."""
    tmp = tmp_path_factory.mktemp("gateway")
    # A small prompt limit, so a too-long prompt is cheap to send.
    daemon = start_daemon(
        tmp / "d", tiny_model, "--resident", env={"MOED_MAX_PROMPT_TOKENS": "512"}
    )
    gateway: GatewayProcess | None = None
    try:
        gateway = start_gateway(tmp / "g", daemon.socket)
        yield daemon, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop()


# --- a second local user (root only) ---------------------------------------------------------


@pytest.fixture
def other_user():
    """A real second local user (root only); removed afterwards."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to create a second user")
    name = f"moedt{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/false", name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)
