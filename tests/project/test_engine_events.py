"""The engine's output is typed (protocol/events.py): engine/ emits event objects and builds no
wire map, so it imports none of the wire builders (protocol/messages.py); the transport encodes
each event with `to_wire`. Checked from the code (parsed with `ast`, nothing imported)."""

from __future__ import annotations

import ast

from tests.fixtures.import_graph import ROOT, imports, source_files

WIRE_BUILDERS = "moed.protocol.messages"
# Where the engine's events are made: engine/, and the request trace it starts (its chunks and
# warnings reach the client through the engine's sink).
EMITTERS = ("moed.daemon.engine", "moed.daemon.telemetry.request_trace")
ENGINE = ROOT / "daemon" / "engine"


def test_the_engine_imports_no_wire_builder():
    found = [
        f"{imp.path.relative_to(ROOT)}:{imp.line}"
        for imp in imports()
        if imp.source.startswith(EMITTERS) and imp.target == WIRE_BUILDERS
    ]
    assert not found, "wire builders imported where engine events are made:\n" + "\n".join(found)


def test_the_engine_calls_no_wire_builder_and_patches_no_message():
    """No `wire.<builder>(...)` call and no `msg["..."] = ...` on a message map in engine/."""
    found = []
    for path in source_files():
        if not path.is_relative_to(ENGINE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "wire"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}")
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "msg"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} =")
    assert not found, "wire maps built or patched in engine/:\n" + "\n".join(found)
