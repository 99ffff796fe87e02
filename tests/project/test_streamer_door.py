"""One door into the expert streamer: outside daemon/experts/ no code assigns an attribute of a
streamer, checked from the code (parsed with `ast`, nothing imported) over the packages, bench,
benchmarks/ and tests/ (fixtures included).

The rule: no assignment (`=`, `+=`, an annotated one, `del`, `setattr`, `monkeypatch.setattr`)
to an attribute reached through a name or attribute called `streamer` (or `..._streamer`),
however deep (`streamer.lane = None`, `loaded.streamer.fence.on_sync = f`,
`streamer.tuner._queue = []`). What the engine hands in goes through the streamer's door
(experts/hooks.py): `attach(EngineHooks(...))` once a model is loaded, and for a step the scopes
of `steps` (a `StepScopes`: the output unused, a prompt end, a request's route observer); benches
and tests use its methods too (`record_routing`, `drop_lane`, `hold_tuning`). A name is what the
scan can see: a streamer under another name is the reviewer's to catch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.fixtures.import_graph import ROOT, source_files

EXPERTS = ROOT / "daemon" / "experts"
STREAMER_NAME = re.compile(r"^_?(\w+_)?streamer$")
SETTERS = ("setattr", "delattr")


def _through_streamer(node: ast.expr) -> bool:
    """Whether `node` (the object whose attribute is set) is a streamer or reached through one."""
    while True:
        if isinstance(node, ast.Name):
            return bool(STREAMER_NAME.match(node.id))
        if isinstance(node, ast.Attribute):
            if STREAMER_NAME.match(node.attr):
                return True
            node = node.value
        elif isinstance(node, (ast.Subscript, ast.Call)):
            node = node.value if isinstance(node, ast.Subscript) else node.func
        else:
            return False


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for e in target.elts for t in _flatten(e)]
    if isinstance(target, ast.Starred):
        return _flatten(target.value)
    return [target]


def assignments(source: str) -> list[tuple[int, str]]:
    """(line, what) for each assignment to a streamer's attribute in `source`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        for target in (t for raw in _targets(node) for t in _flatten(raw)):
            if isinstance(target, ast.Attribute) and _through_streamer(target.value):
                found.append((target.lineno, ast.unparse(target)))
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in SETTERS and _through_streamer(node.args[0]):
                found.append((node.lineno, f"{name}({ast.unparse(node.args[0])}, ...)"))
    return found


def _checked_files() -> list[Path]:
    files = source_files() + sorted((ROOT / "benchmarks").glob("*.py"))
    files += sorted((ROOT / "tests").rglob("*.py"))
    return [p for p in files if EXPERTS not in p.parents]


def test_the_scan_sees_each_kind_of_assignment():
    """The checker itself: each form it must refuse, written the way moed once had it."""
    samples = [
        "recorder.streamer.observer = recorder",
        "self.loaded.streamer.on_progress = self.heartbeat.beat",
        "self.loaded.streamer.fence.on_sync = self.faults.at",
        "streamer.trace = [] if simulate else None",
        "streamer.tuner._queue = []",
        "c.streamer.trace = None",
        "self._streamer.lane = None",
        "streamer.counters.steps += 1",
        "a, streamer.lane = 1, None",
        "setattr(streamer, 'lane', None)",
        "monkeypatch.setattr(streamer, 'device_routing', False)",
        "del rank.streamer.observer",
        "streamer.pools[0].policy = p",
    ]
    for source in samples:
        assert assignments(source), source
    allowed = (
        "self.streamer = streamer\n"  # holding a streamer is not assigning into one
        "streamer_mod.mx = timer\n"  # a module named after it
        "x = streamer.trace\n"
        "streamer.attach(hooks)\n"
        "stream.lane = None\n"
    )
    assert assignments(allowed) == []


def test_no_assignment_to_a_streamer_attribute_outside_experts():
    files = _checked_files()
    assert any(p.name == "trace.py" for p in files), "the scan reads telemetry/trace.py"
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in files
        for line, what in assignments(path.read_text())
    ]
    assert not wrong, (
        "a streamer's attribute assigned outside daemon/experts/ (hand it in through the "
        "streamer's methods: attach, observing, record_routing, ...):\n" + "\n".join(wrong)
    )
