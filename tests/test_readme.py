"""The README's runnable blocks (marked for ``scripts/check_readme.py``, which CI runs on a fresh
copy) use commands and options that exist: a fast check that the README and the CLI agree."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import typer.main

from optimizer.cli import app

ROOT = Path(__file__).resolve().parents[1]


def _check_readme():
    spec = importlib.util.spec_from_file_location("check_readme", ROOT / "scripts" / "check_readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_marked_readme_commands_parse():
    cr = _check_readme()
    blocks = cr.blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 4
    cli = typer.main.get_command(app)
    seen = 0
    for lang, body in blocks:
        if lang != "sh":
            compile(body, "README block", "exec")
            continue
        for cmd in cr.commands(body):
            args = shlex.split(cmd, comments=True)
            if not args or args[0] != "tapestry":
                continue
            command, rest, name = cli, args[1:], "tapestry"
            while hasattr(command, "commands"):  # a group: descend
                name, rest = rest[0], rest[1:]
                assert name in command.commands, f"README: unknown command in {cmd!r}"
                command = command.commands[name]
            command.make_context(name, [a for a in rest if "*" not in a] if "*" not in cmd else
                                 [a if "*" not in a else "x.json" for a in rest])  # parses options, runs nothing
            seen += 1
    assert seen >= 10


def test_commands_are_joined_as_the_shell_would():
    cr = _check_readme()
    body = "a \\\n  b\n# c\ntapestry sql \"SELECT 1\n  FROM t\" --format csv\nx 'it''s'\n"
    got = [shlex.split(c) for c in cr.commands(body)]
    assert got == [["a", "b"], ["tapestry", "sql", "SELECT 1\n  FROM t", "--format", "csv"], ["x", "its"]]
