"""ARCHITECTURE.md's import rules, checked from the code (parsed with `ast`, nothing imported):
which room may import which, no cycle between rooms, mlx only where allowed, the processes that
must start without mlx, a reason beside every function-level import, and the committed drawing of
the room graph current. Function-level and type-only (`if TYPE_CHECKING:`) imports count in the
room rules: a lower room that needs a higher room's type declares a Protocol of its own."""

from __future__ import annotations

import graphlib

from tests.fixtures.import_graph import (
    MLX_ROOTS,
    ROOT,
    committed_drawing,
    drawing,
    imports,
    mlx_rooms,
    room_edges,
    room_of,
)

# room -> the rooms it may import (ARCHITECTURE.md, "Import direction"). Lower rooms first.
_SERVING = {"config", "experts", "ground", "platform", "protocol"}
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "client": {"protocol"},
    "gateway": {"client", "protocol"},
    "ground": {"protocol"},
    "platform": {"ground", "protocol"},
    "experts": {"ground", "platform", "protocol"},
    "config": {"experts", "ground", "protocol"},
    "model": _SERVING | {"client"},  # client: the Hugging Face cache layout (hub_store)
    "distributed": _SERVING | {"model", "client"},
    "telemetry": _SERVING | {"model"},
    "engine": _SERVING | {"model", "distributed", "telemetry"},
    "transport": _SERVING | {"model", "engine", "telemetry"},
    "service": {"config", "ground", "platform", "protocol", "client"},
    "watchdog": {"config", "ground", "platform", "protocol", "client"},
    "bench": _SERVING | {"model", "engine", "telemetry", "client"},
    "runtime": _SERVING
    | {"model", "distributed", "telemetry", "engine", "transport", "service", "client"},
}
ALLOWED["cli"] = set(ALLOWED) | {"gateway"}  # daemon/cli.py: the `moed` group over every command
MLX_ALLOWED = {"engine", "model", "experts", "distributed", "bench"}


def test_every_room_imports_only_what_it_may():
    edges = room_edges()
    rooms = {a for a, _ in edges} | {b for _, b in edges}
    assert rooms <= set(ALLOWED), f"rooms without a rule: {rooms - set(ALLOWED)}"
    wrong = [
        f"{a} -> {b}: {imp.path.relative_to(ROOT)}:{imp.line}"
        for (a, b), found in sorted(edges.items())
        if b not in ALLOWED[a]
        for imp in found
    ]
    assert not wrong, "imports against ARCHITECTURE.md's rules:\n" + "\n".join(wrong)


def test_type_only_imports_obey_the_room_order():
    """An import under `if TYPE_CHECKING:` is held to the same rules as one that runs."""
    type_only = [imp for imp in imports() if imp.type_only]
    assert type_only, "no type-only import found: the scan is broken"
    wrong = [
        f"{a} -> {b}: {imp.path.relative_to(ROOT)}:{imp.line}"
        for imp in type_only
        if (a := room_of(imp.source)) and (b := room_of(imp.target)) and a != b
        if b not in ALLOWED[a]
    ]
    assert not wrong, "type-only imports against the room order:\n" + "\n".join(wrong)


def test_no_cycle_between_rooms_counting_type_only_and_in_function_imports():
    edges = room_edges()
    counted = [imp for found in edges.values() for imp in found]
    assert any(i.type_only for i in counted) and any(i.in_function for i in counted)
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError with the cycle
    # The rules themselves are a hierarchy: nothing is allowed back up.
    graphlib.TopologicalSorter(ALLOWED).prepare()


def test_mlx_only_where_allowed():
    rooms = mlx_rooms()
    assert rooms, "no mlx import found: the scan is broken"
    wrong = {
        room: [f"{i.path.relative_to(ROOT)}:{i.line}" for i in rooms[room]]
        for room in set(rooms) - MLX_ALLOWED
    }
    assert not wrong, wrong


def _startup_closure(entry: str) -> dict[str, str | None]:
    """Every module `import entry` runs (module-level imports, packages included), each with the
    module that imported it; daemon/cli.py's registration runs at import, so it counts."""
    graph: dict[str, set[str]] = {}
    for imp in imports():
        if imp.type_only or (imp.in_function and imp.source != "moed.daemon.cli"):
            continue
        graph.setdefault(imp.source, set()).add(imp.target)
    seen: dict[str, str | None] = {entry: None}
    stack = [entry]
    while stack:
        module = stack.pop()
        parts = module.split(".")
        for nxt in [".".join(parts[:k]) for k in range(1, len(parts))] + sorted(
            graph.get(module, ())
        ):
            if nxt not in seen:
                seen[nxt] = module
                stack.append(nxt)
    return seen


def _chain(seen: dict[str, str | None], module: str) -> list[str]:
    chain = [module]
    while seen[chain[-1]] is not None:
        chain.append(seen[chain[-1]])
    return chain[::-1]


def test_client_and_gateway_start_without_mlx():
    for entry in ("moed.client.cli", "moed.client", "moed.gateway.cli", "moed.gateway.app"):
        seen = _startup_closure(entry)
        heavy = [m for m in seen if m.split(".")[0] in MLX_ROOTS or m.startswith("moed.daemon")]
        assert not heavy, [_chain(seen, m) for m in heavy[:3]]


def test_the_moed_command_starts_without_mlx_lm():
    """mlx-lm (and transformers under it) costs seconds: `moed watchdog`, `moed service` and the
    others never load it; the commands that run a model load it on use."""
    seen = _startup_closure("moed.daemon.cli")
    assert "moed.daemon.runtime.cli" in seen  # the scan follows the registration
    heavy = [m for m in seen if m.split(".")[0] in ("mlx_lm", "transformers")]
    assert not heavy, [_chain(seen, m) for m in heavy[:3]]


def test_function_level_imports_say_why():
    """No import inside a function to dodge a cycle (the room graph above counts them); the ones
    kept for a reason (start-up cost, an OS's own module) carry a comment: on the line, or on the
    line above their block of imports."""
    bare = []
    for imp in imports():
        if not imp.in_function or imp.type_only:
            continue
        if not (imp.target.startswith("moed") or imp.target.split(".")[0] in MLX_ROOTS):
            continue
        lines = imp.path.read_text().splitlines()
        if "#" in lines[imp.line - 1]:
            continue
        at = imp.line - 2
        while at >= 0 and lines[at].strip().startswith(("from ", "import ")):
            at -= 1  # up through the block's other imports
        if at < 0 or not lines[at].strip().startswith("#"):
            bare.append(f"{imp.path.relative_to(ROOT)}:{imp.line} ({imp.target})")
    assert not bare, "function-level imports without a reason:\n" + "\n".join(sorted(set(bare)))


def test_architecture_holds_the_current_drawing():
    assert committed_drawing() == drawing(), (
        "ARCHITECTURE.md's import graph is stale: run `python -m tests.fixtures.import_graph "
        "--write`"
    )
