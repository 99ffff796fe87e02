"""Walk every `moe` and `moed` command: help on every option, the shared global options in the
same places on both tools, --version on both, and a --help that runs. New commands are covered as
they land."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from moed.client.cli import main as moe_main
from moed.client.cli_common import GLOBAL_OPTION_NAMES
from moed.daemon.cli import main as moed_main

TOOLS = {"moe": moe_main, "moed": moed_main}


def walk(command: click.Command, path: tuple[str, ...] = ()):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from walk(sub, (*path, name))


ALL = [(tool, path, cmd) for tool, root in TOOLS.items() for path, cmd in walk(root)]
IDS = [" ".join((tool, *path)) for tool, path, _ in ALL]


def options(cmd: click.Command) -> list[click.Option]:
    return [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]


@pytest.mark.parametrize("tool,path,cmd", ALL, ids=IDS)
def test_every_option_has_help(tool, path, cmd):
    missing = [p.opts[0] for p in options(cmd) if not (p.help or "").strip()]
    assert not missing, f"{' '.join((tool, *path))}: options without help: {missing}"
    assert (cmd.help or cmd.short_help or "").strip(), "the command itself needs a docstring"


@pytest.mark.parametrize("tool,path,cmd", ALL, ids=IDS)
def test_global_options_everywhere(tool, path, cmd):
    names = {p.name for p in cmd.params}
    assert set(GLOBAL_OPTION_NAMES) <= names, f"missing global options on {path}"


@pytest.mark.parametrize("tool,path,cmd", ALL, ids=IDS)
def test_help_runs(tool, path, cmd):
    result = CliRunner().invoke(TOOLS[tool], [*path, "--help"])
    assert result.exit_code == 0, result.output
    for flag in ("--socket", "--state-dir", "--log-dir"):
        assert flag in result.output


def test_global_options_read_the_same_on_both_tools():
    def shared(root):
        return {p.name: p.help for p in root.params if p.name in GLOBAL_OPTION_NAMES}

    assert shared(moe_main) == shared(moed_main) and len(shared(moe_main)) == 3


@pytest.mark.parametrize("tool", TOOLS)
def test_version(tool):
    result = CliRunner().invoke(TOOLS[tool], ["--version"])
    assert result.exit_code == 0 and tool in result.output and "version" in result.output


# Commands whose output a script reads: each offers --json.
JSON_COMMANDS = [
    ("moe", ("run",)),
    ("moe", ("status",)),
    ("moe", ("stats",)),
    ("moe", ("list",)),
    ("moe", ("ps",)),
    ("moe", ("pull",)),
    ("moed", ("service", "status")),
    ("moed", ("trace", "analyze")),
]


@pytest.mark.parametrize(
    "tool,path", JSON_COMMANDS, ids=[" ".join((t, *p)) for t, p in JSON_COMMANDS]
)
def test_json_where_scripts_read(tool, path):
    cmd = TOOLS[tool]
    for name in path:
        cmd = cmd.commands[name]
    assert "--json" in {o for p in options(cmd) for o in p.opts}


def test_a_global_option_after_the_subcommand_wins(tmp_path):
    """`moe --socket A status` and `moe status --socket B`: both parse; the later one is used."""
    from moed.client.cli_common import global_options

    seen = {}

    @click.group()
    def root():
        pass

    @root.command()
    def probe():
        """Probe."""
        seen["socket"] = global_options().socket

    from moed.client.cli_common import add_global_options

    add_global_options(root)
    runner = CliRunner()
    assert runner.invoke(root, ["--socket", "/a", "probe"]).exit_code == 0
    assert str(seen["socket"]) == "/a"
    assert runner.invoke(root, ["--socket", "/a", "probe", "--socket", "/b"]).exit_code == 0
    assert str(seen["socket"]) == "/b"
