"""Helpers shared by CLI commands: loading plans, parsing ``key=value`` settings, output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from optimizer.cli.errors import UserError

console = Console(highlight=False)


def load_plan(path: str, n_devices: int | None = None) -> Any:
    """Load and validate a plan file (raises ``InvalidGraph`` with every problem); with
    ``n_devices``, its devices must exist on a hardware of that many devices."""
    return load_plan_document(path, n_devices)[0]


def load_plan_document(path: str, n_devices: int | None = None) -> tuple[Any, Any]:
    """The plan and its ``ir.serialize.Provenance`` (the program it derives from)."""
    from ir.serialize import load_document

    if not Path(path).exists():
        raise UserError(f"plan file {path!r} does not exist; build one with 'tapestry graph build'")
    return load_document(path, n_devices)


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
