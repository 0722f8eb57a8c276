"""Helpers shared by CLI commands: loading plans, parsing ``key=value`` settings, output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from optimizer.cli.errors import UserError

console = Console(highlight=False)


def load_plan(path: str) -> Any:
    """Load and validate a plan file (raises ``InvalidGraph`` with every problem)."""
    from ir.serialize import load

    if not Path(path).exists():
        raise UserError(f"plan file {path!r} does not exist; build one with 'tapestry graph build'")
    return load(path)


def parse_settings(items: list[str] | None) -> dict[str, Any]:
    """``["batch=8", "widths=[64,128]"]`` → ``{"batch": 8, "widths": [64, 128]}`` (YAML values)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item!r} must look like key=value, e.g. --set batch=8")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UserError(f"--set {item!r}: value {value!r} is not a number, list or word") from None
    return out


def write_text(path: str, text: str) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise UserError(f"cannot write {path!r}: folder {str(p.parent)!r} does not exist")
    p.write_text(text)
