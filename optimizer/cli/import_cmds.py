"""``tapestry import MODEL -o program.json`` and ``tapestry codegen PLAN -o run_plan.py``.

``import`` reads an ONNX file (or ``module.py:factory`` for a PyTorch module, exported through
ONNX) and writes the program as graph JSON plus its parameter values beside it (same stem,
``.npz``). ``codegen`` writes, for a plan, a standalone multi-process Python program that runs it
(``executor.codegen``) and the DTensor placements of its tensors (``<stem>.placements.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from optimizer.cli.common import console, load_plan_document, parse_settings, write_text
from optimizer.cli.errors import UserError


def _example_inputs(items: list[str]) -> list[tuple[str, str, list[int | tuple[str, int]]]]:
    """``["x:float32[8,64]"]`` -> ``[("x", "float32", [8, 64])]``; a named dim ``batch=8`` is
    ``("batch", 8)`` (symbolic: traced small, bound at 8; ``import_torch_factory``)."""
    import re

    out = []
    for item in items:
        m = re.fullmatch(r"\s*([A-Za-z_][\w.]*)\s*:\s*(float32|float16|int64|int32)\s*\[([\w=,\s]+)\]\s*", item)
        dims = [re.fullmatch(r"\s*(?:([A-Za-z_]\w*)\s*=\s*)?(\d+)\s*", d) for d in m.group(3).split(",")] if m else []
        if not m or not all(dims) or any(int(d.group(2)) < 1 for d in dims):
            raise UserError(f"--example-input {item!r} must look like NAME:DTYPE[d0,d1,...], e.g. x:float32[8,64], "
                            f"or with named dims traced small and bound at the size given, x:int64[batch=8,seq=4096] "
                            f"(dtypes float32, float16, int64, int32; sizes >= 1)")
        out.append((m.group(1), m.group(2), [(d.group(1), int(d.group(2))) if d.group(1) else int(d.group(2))
                                             for d in dims]))
    return out


def import_program(model: str, params: dict[str, Any], example_inputs: list[str] | None = None,
                   batchnorm: str = "eval") -> tuple[Any, dict]:
    """(graph, parameter values) of an ONNX file or a ``module.py:factory`` PyTorch model;
    ``batchnorm`` (PyTorch only): ``"train"`` normalises its batch norms with batch statistics."""
    if batchnorm not in ("eval", "train"):
        raise UserError(f"--batchnorm {batchnorm!r} must be eval (running statistics) or train (batch statistics)")
    if ".py:" in model:
        from ir.importers.torch_export import import_torch_factory

        if not example_inputs:
            raise UserError("a PyTorch model needs --example-input NAME:DTYPE[dims] for each forward argument, "
                            "e.g. --example-input x:float32[8,64]")
        if params:
            raise UserError(f"--set {', '.join(sorted(params))} binds symbolic dims of an ONNX file; a PyTorch "
                            f"model's dims are the --example-input shapes (give x:float32[8,128] for batch 8, "
                            f"seq 128) and --set has nothing to bind")
        from executor.run import execute

        return import_torch_factory(model, _example_inputs(example_inputs), params, batchnorm=batchnorm, run=execute)
    if model.endswith(".py"):
        raise UserError(f"{model!r} is a Python file; name the function that returns the torch.nn.Module: "
                        f"{model}:make_model")
    if example_inputs:
        raise UserError("--example-input is for PyTorch models (module.py:factory); an ONNX file declares its "
                        "inputs; bind symbolic dims with --set NAME=N")
    if batchnorm != "eval":
        raise UserError("--batchnorm is for PyTorch models (module.py:factory); an ONNX file's "
                        "BatchNormalization nodes say their mode (training_mode=1: batch statistics)")
    from ir.importers.onnx import import_onnx

    return import_onnx(model, params)


def import_cmd(
    model: Annotated[str, typer.Argument(help="model.onnx, or module.py:factory returning a torch.nn.Module")],
    out: Annotated[str, typer.Option("-o", "--out", help="program file to write (JSON); values go to <stem>.npz")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="symbolic dim, NAME=N (e.g. batch=8)")] = None,
    example_input: Annotated[Optional[list[str]], typer.Option(
        "--example-input", help="PyTorch only: NAME:DTYPE[d0,d1,...] per forward argument")] = None,
    batchnorm: Annotated[str, typer.Option(
        "--batchnorm", help="PyTorch only: eval (running statistics, default) or train (batch statistics, as "
                            "BatchNorm trains)")] = "eval",
    train: Annotated[Optional[str], typer.Option(
        "--train", help="write one training step instead of the forward: its loss, mse (against an input "
                        "'target') or cross_entropy (logits [..., vocab] against int 'labels')")] = None,
    optimizer: Annotated[str, typer.Option(
        "--optimizer", help="with --train: adamw (default) or sgd")] = "adamw",
) -> None:
    """Import an ONNX (or PyTorch) model as a program; its weights are written beside it (.npz).
    With ``--train LOSS``, the program is one training step of it (forward, loss, backward,
    optimizer update: ``ir.autodiff.training_step``)."""
    from ir.importers.values import save_values, values_file
    from ir.serialize import dumps

    if not out.endswith(".json"):
        raise UserError(f"--out {out!r} must end in .json (the values are written beside it as .npz)")
    if train is not None and train not in ("mse", "cross_entropy"):
        raise UserError(f"--train {train!r} must be mse or cross_entropy (the loss of the training step)")
    if train is None and optimizer != "adamw":
        raise UserError("--optimizer applies to a training step: add --train mse or --train cross_entropy")
    g, values = import_program(model, parse_settings(set_), example_input, batchnorm)
    if train is not None:
        g = _training_step(g, train, optimizer)
    write_text(out, dumps(g) + "\n")
    save_values(values, values_file(out))
    kinds: dict[str, int] = {}
    for o in g.ops.values():
        kinds[o.kernel] = kinds.get(o.kernel, 0) + 1
    console.print(f"wrote {out}: {len(g.ops)} ops ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}), "
                  f"{sum(1 for t in g.tensors.values() if t.role == 'parameter')} parameters in "
                  f"{values_file(out)}, digest {g.digest[:12]}")


def _training_step(g: Any, loss: str, optimizer: str) -> Any:
    """The training step of imported program ``g``; the autodiff's refusals are user errors."""
    from ir.autodiff import training_step
    from ir.autodiff.errors import AutodiffError

    try:
        return training_step(g, loss=loss, optimizer=optimizer)
    except AutodiffError as e:
        raise UserError(f"--train {loss} --optimizer {optimizer}: {e}") from None


def simulated_order(g: Any, hw: Any) -> dict[int, list[tuple[str, int]]]:
    """Each device's shards in the cost model's simulated start order (ties: topological)."""
    from costmodel import evaluate

    ev = evaluate(g, hw, keep=True)
    low, s = ev.lowered, ev.schedule
    topo = {n: k for k, n in enumerate(g.topo_order)}
    steps = []
    for i, name in enumerate(low.op_names):
        a = int(low.op_offsets[i])
        for j in range(len(g.ops[name].shards)):
            steps.append((float(s.start[a + j]), topo[name], j, name, int(g.ops[name].shards.device[j])))
    order: dict[int, list[tuple[str, int]]] = {}
    for _, _, j, name, d in sorted(steps):
        order.setdefault(d, []).append((name, j))
    return order


def write_plan_program(g: Any, out: str | Path, hardware: Any = None, program: Any = None) -> tuple[Path, Path, dict]:
    """Write the generated program for plan ``g`` and its DTensor placements beside it.

    With ``hardware`` the steps run in the simulated schedule's order on it; without, in
    topological order. ``program``: the program ``g`` derives from, for the generated
    ``--check``. Returns (program path, placements path, placements).
    """
    from costmodel.transfers import transfer_plan
    from executor.codegen import generate_program
    from executor.codegen.dtensor import dtensor_placements

    hw = None
    if isinstance(hardware, str) and hardware:
        from costmodel import load_hardware

        hw = load_hardware(hardware)
    elif hardware is not None and not isinstance(hardware, str):
        hw = hardware  # a costmodel.Hardware
    if program is None:
        from ir.rewrites import unshard

        program = g if unshard(g).digest == g.digest else None  # an unsharded program is its own reference
    n = hw.n_devices if hw is not None else max(g.devices) + 1
    tp = transfer_plan(g, hw if hw is not None else n)
    plain = tp.to_json()
    order = simulated_order(g, hw) if hw is not None else None
    src = generate_program(g, plain["transfers"], plain["residency"], order,
                           title=f"Plan {g.digest[:12]}" + (f" on {hw.name}" if hw is not None else ""),
                           state_transfers=plain.get("state_transfers", ()), program=program)
    out = Path(out)
    write_text(str(out), src)
    placements = dtensor_placements(g, plain["residency"])
    ppath = out.with_suffix(".placements.json")
    write_text(str(ppath), json.dumps(placements, indent=1) + "\n")
    return out, ppath, placements


def codegen_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    out: Annotated[str, typer.Option("-o", "--out", help="program to write (.py)")],
    hardware: Annotated[Optional[str], typer.Option(
        help="preset or YAML: order each device's steps as the cost model's schedule does")] = None,
) -> None:
    """Write a standalone program that runs a plan, one process per device, and its DTensor placements."""
    if not out.endswith(".py"):
        raise UserError(f"--out {out!r} must end in .py")
    g, prov = load_plan_document(plan)
    prog, ppath, placements = write_plan_program(g, out, hardware, prov.program)
    note = "all tensors expressible as DTensor placements" if placements["expressible"] else \
        f"{len(placements['not_expressible'])} tensors not expressible as DTensor placements (see the file)"
    console.print(f"wrote {prog} ({len(g.devices)} device processes; run: python {prog} --check) and {ppath}: {note}")


def export_programs(campaign: str, out: str, db: str | None = None) -> int:
    """``tapestry export CAMPAIGN --program``: beside every exported plan ``plans/NN_<digest>.json``,
    its generated program (``.py``, steps in the simulated order on the campaign's hardware) and
    DTensor placements; for an ONNX workload, the model's weights as ``program.npz`` in ``out``.
    Returns the number of programs written."""
    from costmodel.hardware import Hardware
    from ir.importers.values import save_values
    from ir.serialize import load_document
    from optimizer.campaign.lifecycle import program_from_archive, resolve_url
    from storage import Archive

    with Archive.open(resolve_url("tapestry.db", db), readonly=True) as archive:
        row = archive.get_campaign(campaign)
    hw = Hardware.from_dict(row["config"]["hardware"])
    workload = (row["config"].get("config") or {}).get("workload") or {}
    if workload.get("onnx"):
        from ir.importers.onnx import import_onnx

        _, values = import_onnx(workload["onnx"], workload.get("params") or {})
        save_values(values, Path(out) / "program.npz")
    n = 0
    programs: dict[str, Any] = {}
    for plan in sorted((Path(out) / "plans").glob("*.json")):
        if plan.name.endswith(".placements.json"):
            continue
        g, prov = load_document(plan)
        program = prov.program
        if program is None and prov.program_digest:  # the campaign's program, for the generated --check
            if prov.program_digest not in programs:
                programs[prov.program_digest] = program_from_archive(db, prov.program_digest)
            program = programs[prov.program_digest]
        write_plan_program(g, plan.with_suffix(".py"), hw, program)
        n += 1
    return n
