"""``tapestry experts PROGRAM --hardware H1,H2 [--layers auto] [--json] [--out DIR]``: the expert
plans of a program (``optimizer.search.baselines``: ZeRO-3, Megatron TP x DP, DP x CP, DP x EP,
3D, ...) on one or more fleets, evaluated side by side, so a planner sees in a minute which fleet
and which recipe a campaign should start from; ``--out`` writes each plan (naming the program,
so ``verify``, ``eval`` and ``codegen`` take it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from optimizer.cli.common import console, load_plan_document
from optimizer.cli.errors import UserError


def _program(path: str) -> Any:
    """The program a plan file names (embedded), or the plan's own unsharded form."""
    from ir.rewrites import unshard

    g, prov = load_plan_document(path)
    return prov.program if prov.program is not None else unshard(g)


def experts_report(plan: str, hardware: list[str], layers: str = "auto", out: str | None = None) -> list[dict]:
    """One row per (fleet, expert plan): the plan's objectives on that fleet, the fleets in the
    order given and each fleet's plans fastest first among those that fit, then the others.
    ``layers``: ``auto`` (``costmodel.repetition.layers_mode``), ``whole`` or ``repeat``.
    ``out``: write each plan to ``out/<fleet>/<expert>.json``."""
    from costmodel import Evaluator, load_hardware
    from costmodel.repetition import layers_mode
    from ir.serialize import dumps
    from optimizer.search.baselines import baselines

    if layers not in ("auto", "whole", "repeat"):
        raise UserError(f"--layers {layers}: expected auto, whole or repeat")
    if not hardware:
        raise UserError("--hardware: name one or more fleets (presets or hardware YAML files), e.g. "
                        "--hardware h100-sxm-64,b200-64")
    fleets = [load_hardware(h) for h in hardware]  # every name checked before any work
    program = _program(plan)
    mode = layers_mode(program, layers)
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"--out {out} is a file; give a folder (it is created when missing)")
    rows = []
    for hw in fleets:
        ev = Evaluator(hw, layers=mode)
        mine = []
        for name, g in baselines(program, hw.n_devices, hw.devices_per_node).items():
            e = ev(g)
            row = {"hardware": hw.name, "expert": name, "n_devices": hw.n_devices,
                   "memory_capacity": hw.device.mem_capacity, **e.to_json()}
            if out is not None:
                path = Path(out) / re.sub(r"[^\w.-]", "_", hw.name) / f"{name}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(dumps(g, program=program) + "\n")
                row["file"] = str(path)
            mine.append(row)
        mine.sort(key=lambda r: (not r["feasible"], r["makespan"]))
        rows += mine
    return rows


def print_experts(rows: list[dict]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from optimizer.cli.eval_cmd import _si

    out = console if console.is_terminal else Console(width=max(console.width, 120), highlight=False)
    t = Table(title="expert plans, fastest first on each fleet (★: the fastest that fits)", box=box.SIMPLE_HEAD,
              pad_edge=False)
    for col in ("fleet", "expert", "step", "peak / device", "fits", "energy", "MFU", "moved"):
        t.add_column(col, justify="left" if col in ("fleet", "expert", "fits") else "right", no_wrap=True)
    seen: set[str] = set()
    for r in rows:
        best = r["feasible"] and r["hardware"] not in seen
        if best:
            seen.add(r["hardware"])
        t.add_row(r["hardware"], ("★ " if best else "  ") + r["expert"], _si(r["makespan"], "s"),
                  f"{_si(r['peak_memory'], 'B')} of {_si(r['memory_capacity'], 'B')}",
                  "yes" if r["feasible"] else "NO", _si(r["energy"], "J"),
                  f"{100 * r['mfu']:.1f} %" if r.get("mfu") else "-", _si(r["bytes_moved"], "B"))
    out.print(t)
    if any("file" in r for r in rows):
        out.print(f"plans written under {Path(rows[0]['file']).parent.parent} (<fleet>/<expert>.json)")


def experts_cmd(
    program: Annotated[str, typer.Argument(help="program or plan file (JSON), e.g. from 'tapestry graph build' "
                                           "or 'tapestry import'")],
    hardware: Annotated[list[str], typer.Option("--hardware", "-H", help="fleets: presets or hardware YAML "
                                                "files, comma-separated or repeated")],
    layers: Annotated[str, typer.Option("--layers", help="auto: models of 16 or more numbered layers from two "
                                        "truncations (costmodel.repetition); whole; repeat")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="write each expert plan to "
                                               "OUT/<fleet>/<expert>.json")] = None,
) -> None:
    """The expert plans of a program on one or more fleets, evaluated side by side: step time,
    peak memory per device and whether it fits, energy, MFU, bytes moved."""
    names = [h.strip() for item in hardware for h in item.split(",") if h.strip()]
    rows = experts_report(program, names, layers, out)
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        print_experts(rows)
