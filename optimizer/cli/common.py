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


def reference_program(g: Any, prov: Any, reference: str | None, db: str | None, self_check: bool) -> tuple[Any, str]:
    """The program plan ``g`` (with provenance ``prov``, ``load_plan_document``) must compute, and
    how it was found: ``--reference``, ``--self-check`` (its own unsharded form), the embedded
    program, the archive's copy (``--db``), or the plan itself when it is unsharded; ``UserError``
    when none can be found (a PASS would then only show the plan agrees with itself)."""
    from ir.rewrites import unshard

    want = prov.program_digest
    if reference:
        ref = unshard(load_plan(reference))
        if want and ref.digest != want:
            raise UserError(f"--reference {reference} is program {ref.digest[:12]}, but the plan derives from program "
                            f"{want[:12]}; pass the program the plan was built from")
        return ref, f"--reference {reference}"
    if self_check:
        return unshard(g), "the plan's own unsharded form (--self-check: the sharding, not the program)"
    if prov.program is not None:
        return prov.program, f"the embedded program {want[:12]}"
    if want and db:
        from optimizer.campaign.lifecycle import program_from_archive

        return program_from_archive(db, want), f"program {want[:12]} from the archive"
    if want:
        raise UserError(f"the plan derives from program {want[:12]}, which is neither embedded in it nor given: pass "
                        f"--reference PROGRAM.json, or --db with the archive of its campaign")
    if unshard(g).digest == g.digest:
        return g, "the plan is itself an unsharded program"
    raise UserError("the plan does not say which program it derives from (plans written before this version, or "
                    "edited by hand), so a PASS would only show it agrees with itself; pass --reference "
                    "PROGRAM.json (e.g. from 'tapestry graph build'), or --self-check to check just the sharding")


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


def check_output_path(path: str, option: str = "--out") -> Path:
    """``path`` as a file this command may write, or ``UserError`` naming ``option``: its folder
    must exist and it must not be a folder itself."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{option} {path!r} is a folder; name the file to write (it may be one inside that folder)")
    if not p.parent.is_dir():
        raise UserError(f"cannot write {option} {path!r}: folder {str(p.parent)!r} does not exist")
    return p


def write_text(path: str, text: str, option: str = "--out") -> None:
    """Write ``text`` to ``path`` (``check_output_path``); an operating system refusal (no
    permission, a full disk) is a ``UserError`` too."""
    p = check_output_path(path, option)
    try:
        p.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write {option} {path!r}: {e.strerror or e}") from None
