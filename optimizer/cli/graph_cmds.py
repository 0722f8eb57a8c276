"""``tapestry graph build|rewrite|show|validate|render`` and ``tapestry verify``."""

from __future__ import annotations

import contextlib
import math
from typing import Annotated, Optional

import typer

from optimizer.cli.common import console, load_plan, load_plan_document, parse_settings, reference_program, write_text
from optimizer.cli.errors import UserError

graph_app = typer.Typer(help="Build, rewrite, inspect, validate and render block graphs.", no_args_is_help=True)


def _apply_moves(g, moves: list[str]):
    from ir.rewrites import parse_move

    if moves and not any(t.strip() for text in moves for t in text.split(";")):
        raise UserError(f"no move in {moves!r}; moves look like split{{op=fc1,dim=o,parts=4}}, several joined by ';'")
    for text in moves:
        g = parse_move(text).apply(g)
    return g


@graph_app.command("build")
def build_cmd(
    workload: Annotated[str, typer.Argument(help="built-in workload: mlp, transformer, convnet, gpt or llama")],
    out: Annotated[str, typer.Option("-o", "--out", help="plan file to write (JSON)")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="workload parameter, key=value")] = None,
    rewrite: Annotated[Optional[list[str]], typer.Option("--rewrite", "-r",
                                                         help="move to apply, e.g. split{op=fc1,dim=o,parts=4}")] = None,
) -> None:
    """Build a built-in workload (optionally rewritten) and write it as a plan file that names
    (and embeds) its program, so that 'tapestry verify' checks plans derived from it against it."""
    from ir import workloads
    from ir.rewrites import unshard
    from ir.serialize import dumps

    built = workloads.build(workload, **parse_settings(set_))
    g = _apply_moves(built, rewrite or [])
    write_text(out, dumps(g, program=unshard(built)) + "\n")
    console.print(f"wrote {out}: {len(g.ops)} ops, {g.n_shards} shards, digest {g.digest[:12]}")


@graph_app.command("rewrite")
def rewrite_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    moves: Annotated[list[str], typer.Argument(help="moves, e.g. 'split{op=fc1,dim=o,parts=4}' 'fuse{producer=fc1,consumer=act1}'")],
    out: Annotated[str, typer.Option("-o", "--out", help="plan file to write")],
) -> None:
    """Apply rewrite moves to a plan; each move must be legal or nothing is written. The output
    names the same program as the input (or the input itself, when the input is a program)."""
    from ir.rewrites import unshard
    from ir.serialize import dumps

    g0, prov = load_plan_document(plan)
    g = _apply_moves(g0, moves)
    program = prov.program
    if prov.program_digest is None and unshard(g0).digest == g0.digest:
        program = g0  # the input is an unsharded program: the plans derived from it name it
    write_text(out, dumps(g, program=program, program_digest=prov.program_digest) + "\n")
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
def validate_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="preset or hardware YAML the plan is "
                                                    "for: its devices must exist there")] = None,
) -> None:
    """Validate a plan file; lists every problem and exits 2 when it is invalid."""
    n_devices = None
    if hardware:
        from costmodel.hardware_io import load_hardware

        n_devices = load_hardware(hardware).n_devices
    g = load_plan(plan, n_devices)
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
    reference: Annotated[Optional[str], typer.Option(help="the program the plan must compute (a plan or program "
                                                     "file; its unsharded form is the reference)")] = None,
    db: Annotated[Optional[str], typer.Option(help="archive to find the plan's program in (by its digest)")] = None,
    self_check: Annotated[bool, typer.Option("--self-check", help="compare with the plan's own unsharded form: "
                                             "proves the sharding consistent, not the program")] = False,
    seed: Annotated[int, typer.Option(help="seed of the random inputs")] = 0,
    backend: Annotated[str, typer.Option(help="numpy or cupy")] = "numpy",
    values: Annotated[Optional[str], typer.Option(
        help="parameter values (.npz from 'tapestry import'); default: <plan stem>.npz when it exists")] = None,
    max_bytes: Annotated[float, typer.Option(help="most bytes of tensors both runs may hold")] = 4 * 2**30,
    max_flops: Annotated[float, typer.Option(help="most FLOPs both runs may compute")] = 2e12,
    timeout: Annotated[float, typer.Option(help="stop after this many seconds")] = 600.0,
) -> None:
    """Run a plan and the program it derives from on the same random inputs and compare outputs.

    The program is, in order: --reference; the program embedded in the plan file (written by
    'graph build', 'graph rewrite' and 'export'); the archive's copy (--db) of the program the
    plan names; the plan itself when it is an unsharded program. A plan whose program cannot be
    found is an error, not a PASS (--self-check compares it with its own unsharded form instead).
    Exit status 0 when the outputs agree within the dtype's tolerance, 1 when they do not, 2 for
    bad input.
    """
    from pathlib import Path

    from executor import verify
    from ir.importers.values import load_values, values_file

    if backend not in ("numpy", "cupy"):
        raise UserError(f"--backend {backend!r} is not one of numpy, cupy")
    if values is not None and not Path(values).is_file():
        what = "is a folder" if Path(values).is_dir() else "does not exist"
        raise UserError(f"--values {values!r} {what}; it is the .npz 'tapestry import' writes beside the program")
    if seed < 0:
        raise UserError(f"--seed must be >= 0, got {seed}")
    for option, v in (("--max-bytes", max_bytes), ("--max-flops", max_flops), ("--timeout", timeout)):
        if not (math.isfinite(v) and v > 0):
            raise UserError(f"{option} must be a positive number, got {v}")
    vfile = values or (str(values_file(plan)) if values_file(plan).is_file() else None)
    g, prov = load_plan_document(plan)
    ref, how = reference_program(g, prov, reference, db, self_check)
    with _time_limit(timeout, "verify"):
        report = verify(g, seed=seed, reference=ref, backend=backend, values=load_values(vfile) if vfile else None,
                        max_bytes=max_bytes, max_flops=max_flops)
    console.print(f"{report} [reference: {how}]", markup=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(1)


@contextlib.contextmanager
def _time_limit(seconds: float, what: str):  # noqa: ANN202
    """Raise ``UserError`` when the body runs longer than ``seconds`` (main thread only)."""
    import signal
    import threading

    if not 0 < seconds <= 86_400:
        raise UserError(f"--timeout must be between 0 and 86400 seconds, got {seconds}")
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):  # noqa: ARG001, ANN001
        raise UserError(f"{what} stopped after {seconds:g} s (--timeout); try a smaller instance of the program")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
