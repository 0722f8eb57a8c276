"""``tapestry graph build|rewrite|show|validate|render`` and ``tapestry verify``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from optimizer.cli.common import console, load_plan, parse_settings, write_text
from optimizer.cli.errors import UserError

graph_app = typer.Typer(help="Build, rewrite, inspect, validate and render block graphs.", no_args_is_help=True)


def _apply_moves(g, moves: list[str]):
    from ir.rewrites import parse_move

    for text in moves:
        g = parse_move(text).apply(g)
    return g


@graph_app.command("build")
def build_cmd(
    workload: Annotated[str, typer.Argument(help="built-in workload: mlp, transformer or convnet")],
    out: Annotated[str, typer.Option("-o", "--out", help="plan file to write (JSON)")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="workload parameter, key=value")] = None,
    rewrite: Annotated[Optional[list[str]], typer.Option("--rewrite", "-r",
                                                         help="move to apply, e.g. split{op=fc1,dim=o,parts=4}")] = None,
) -> None:
    """Build a built-in workload (optionally rewritten) and write it as a plan file."""
    from ir import workloads
    from ir.serialize import dumps

    g = _apply_moves(workloads.build(workload, **parse_settings(set_)), rewrite or [])
    write_text(out, dumps(g) + "\n")
    console.print(f"wrote {out}: {len(g.ops)} ops, {g.n_shards} shards, digest {g.digest[:12]}")


@graph_app.command("rewrite")
def rewrite_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    moves: Annotated[list[str], typer.Argument(help="moves, e.g. 'split{op=fc1,dim=o,parts=4}' 'fuse{producer=fc1,consumer=act1}'")],
    out: Annotated[str, typer.Option("-o", "--out", help="plan file to write")],
) -> None:
    """Apply rewrite moves to a plan; each move must be legal or nothing is written."""
    from ir.serialize import dumps

    g = _apply_moves(load_plan(plan), moves)
    write_text(out, dumps(g) + "\n")
    console.print(f"wrote {out}: {len(g.ops)} ops, {g.n_shards} shards, digest {g.digest[:12]}")


@graph_app.command("show")
def show_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    mesh: Annotated[Optional[str], typer.Option(
        help="device mesh to read layouts on, axis sizes outer first (e.g. 8x8; default: nodes of 8 "
             "x 8, or one node, from the devices the plan uses)")] = None,
) -> None:
    """Print a plan one line per operation, with each op's index dims split over mesh axes
    (``b/8 over n0 · h/8 over g0``; ``kb(f)`` is a split hidden reduction: partial sums)."""
    from ir.layout_describe import describe
    from ir.mesh import MeshError, parse_mesh

    g = load_plan(plan)
    try:
        m = parse_mesh(mesh) if mesh else None
    except MeshError as e:
        raise UserError(f"--mesh: {e}") from None
    print(describe(g, m))


@graph_app.command("validate")
def validate_cmd(plan: Annotated[str, typer.Argument(help="plan file (JSON)")]) -> None:
    """Validate a plan file; lists every problem and exits 2 when it is invalid."""
    g = load_plan(plan)
    console.print(f"{plan}: valid ({len(g.ops)} ops, {g.n_shards} shards on {len(g.devices)} devices, "
                  f"digest {g.digest})")


@graph_app.command("render")
def render_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    out: Annotated[str, typer.Option("-o", "--out", help="picture to write: .svg or .dot")],
    max_shards: Annotated[int, typer.Option(help="summarise ops with more shards than this per device")] = 16,
) -> None:
    """Draw a plan: tensors, and each operation's shards coloured by device."""
    from ir.dot import render_svg, to_dot

    if not out.endswith((".svg", ".dot")):
        raise UserError(f"--out {out!r} must end in .svg or .dot")
    text = to_dot(load_plan(plan), max_shards)
    write_text(out, render_svg(text) if out.endswith(".svg") else text)
    console.print(f"wrote {out}")


def verify_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    seed: Annotated[int, typer.Option(help="seed of the random inputs")] = 0,
    backend: Annotated[str, typer.Option(help="numpy or cupy")] = "numpy",
    values: Annotated[Optional[str], typer.Option(
        help="parameter values (.npz from 'tapestry import'); default: <plan stem>.npz when it exists")] = None,
) -> None:
    """Run a plan and its unsharded original on the same random inputs and compare outputs.

    Exit status 0 when the outputs agree within the dtype's tolerance, 1 when they do not.
    """
    from pathlib import Path

    from executor import verify
    from ir.importers.values import load_values, values_file

    if values is not None and not Path(values).is_file():
        raise UserError(f"--values {values!r} does not exist; 'tapestry import' writes it beside the program")
    vfile = values or (str(values_file(plan)) if values_file(plan).is_file() else None)
    report = verify(load_plan(plan), seed=seed, backend=backend, values=load_values(vfile) if vfile else None)
    console.print(str(report))
    if not report.ok:
        raise typer.Exit(1)
