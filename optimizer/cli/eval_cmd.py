"""``tapestry eval PLAN.json --hardware PRESET|FILE.yaml [--json] [--explain] [--gantt FILE]``:
objectives and a cost breakdown; ``--explain`` adds where the time goes (``costmodel.explain``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from optimizer.cli.common import check_output_path, console, load_plan
from optimizer.cli.errors import UserError


def _si(x: float, unit: str, sep: str = " ") -> str:
    """``1.23 ms``, ``4.5 GB``: three significant digits with an SI prefix."""
    if x == 0:
        return f"0{sep}{unit}"
    for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n")):
        if abs(x) >= f:
            return f"{x / f:.3g}{sep}{p}{unit}"
    return f"{x:.3g}{sep}{unit}"


def eval_report(plan: str, hardware: str, explain: bool = False, gantt: str | None = None,
                layers: str = "whole") -> dict[str, Any]:
    """Evaluate a plan file on a hardware preset or YAML file; plain data for printing or JSON.
    ``explain``: add per-op bounds, the critical path and the collectives; ``gantt``: draw the
    schedule to this PNG/SVG file. ``layers="repeat"``: a model of repeated layers from two
    truncations (``costmodel.repetition``; objectives only, no per-op breakdown)."""
    from costmodel import evaluate, load_hardware

    hw = load_hardware(hardware)
    g = load_plan(plan, hw.n_devices)  # its devices must exist on this hardware
    extra: dict[str, Any] = {}
    if layers == "repeat":
        if explain or gantt:
            raise UserError("--layers repeat simulates two truncations of the plan, not the plan: "
                            "--explain and --gantt need --layers whole")
        from costmodel import Evaluator

        e = Evaluator(hw, layers="repeat")(g)
        if e.repetition is not None:
            return {"plan": plan, "hardware": hw.name, "n_devices": hw.n_devices, "ops": len(g.ops),
                    "shards": g.n_shards, "digest": g.digest, **e.to_json(), "memory_capacity": hw.device.mem_capacity,
                    "breakdown": {"devices": [], "ops": []}}
        extra["note"] = ("--layers repeat: the plan has no class of five or more alike numbered layers to extend "
                         "along, so it was simulated whole")
    if explain or gantt:
        from costmodel import Evaluator
        from costmodel import explain as ex

        why = ex.explain(Evaluator(hw), g)
        e = why.pop("evaluation")
        if explain:
            extra["explain"] = why
        if gantt:
            extra["gantt"] = str(ex.gantt(e, gantt, f"{plan} on {hw.name}"))
    else:
        e = evaluate(g, hw, keep=True)
    b = e.breakdown()
    return {**extra, "plan": plan, "hardware": hw.name, "n_devices": hw.n_devices, "ops": len(g.ops), "shards": g.n_shards,
            "digest": g.digest, **e.to_json(), "memory_capacity": hw.device.mem_capacity,
            "breakdown": {"devices": b.devices, "ops": b.ops}}


def print_report(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # piped or redirected: do not squeeze the tables into 80 columns
    out = console if console.is_terminal else Console(width=max(console.width, 120), highlight=False)

    head = Table(title=f"{r['plan']} on {r['hardware']} ({r['ops']} ops, {r['shards']} shards)", show_header=False)
    head.add_column("objective", style="bold")
    head.add_column("value", justify="right")
    head.add_row("makespan", _si(r["makespan"], "s"))
    head.add_row("lower bound", _si(r["lower_bound"], "s"))
    head.add_row("gap (makespan / bound)", f"{r['gap']:.3g}")
    head.add_row("energy", _si(r["energy"], "J"))
    cap = r["memory_capacity"]
    head.add_row("peak memory (max device)", f"{_si(r['peak_memory'], 'B')} of {_si(cap, 'B')}")
    head.add_row("feasible (memory fits)", "yes" if r["feasible"] else "NO")
    head.add_row("devices used", f"{int(r['devices'])} of {r['n_devices']}")
    head.add_row("bytes moved", _si(r["bytes_moved"], "B"))
    if r.get("model_flops"):
        head.add_row("model FLOPs per step", _si(r["model_flops"], "FLOP"))
        head.add_row("MFU (model FLOPs / makespan x peak)", f"{100 * r['mfu']:.1f} %")
    if r.get("memory_floor"):
        head.add_row("memory floor (state / devices)", _si(r["memory_floor"], "B"))
    out.print(head)
    if r.get("note"):
        out.print(f"  {r['note']}")
    if "simulated_layers" in r:
        s, b = r["simulated_layers"]
        out.print(f"  extended from truncations of {s} and {b} of its {r['layers']} layers (--layers repeat); "
                  "--layers whole for the per-op and per-device tables")
        return

    from rich import box

    c = lambda x, unit: _si(x, unit, "")  # noqa: E731  (compact: 133µs)
    ops = Table(title="per operation", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("op", "shards", "devices", "FLOP", "compute", "in bytes", "in time", "start", "finish"):
        ops.add_column(col, justify="left" if col in ("op", "devices") else "right", no_wrap=True)
    for o in r["breakdown"]["ops"]:
        ops.add_row(o["op"], str(o["shards"]), _devices(o["devices"]), c(o["flops"], ""), c(o["compute_s"], "s"),
                    c(o["in_bytes"], "B"), c(o["in_s"], "s"), c(o["start"], "s"), c(o["finish"], "s"))
    out.print(ops)
    out.print("  compute: sum of the op's shard times; in: transfers bringing its inputs to other devices")

    devs = Table(title="per device (used)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("device", "shards", "compute", "comm out+in", "idle", "peak memory", "resident"):
        devs.add_column(col, justify="right", no_wrap=True)
    for d in r["breakdown"]["devices"]:
        if d["used"]:
            devs.add_row(str(d["device"]), str(d["shards"]), c(d["compute_s"], "s"), c(d["comm_s"], "s"),
                         c(d["idle_s"], "s"), c(d["peak_memory"], "B"), c(d["resident_memory"], "B"))
    out.print(devs)
    if "explain" in r:
        _print_explain(out, r["explain"])
    if "gantt" in r:
        out.print(f"schedule drawn to {r['gantt']}")


def _print_explain(out: Any, x: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    c = lambda v, unit: _si(v, unit, "")  # noqa: E731
    n = x["bounds"]
    out.print(f"where the time goes: {n['compute']} ops compute-bound, {n['memory']} memory-bound, "
              f"{n['comm']} communication-bound (their incoming transfers take longer than their compute)")
    t = Table(title="ops by compute time (top 15)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("op", "bound", "compute", "FLOP time", "memory time", "comm in"):
        t.add_column(col, justify="left" if col in ("op", "bound") else "right", no_wrap=True)
    for o in sorted(x["ops"], key=lambda o: -o["compute_s"])[:15]:
        t.add_row(o["op"], o["bound"], c(o["compute_s"], "s"), c(o["flop_s"], "s"), c(o["memory_s"], "s"),
                  c(o["comm_s"], "s"))
    out.print(t)
    path = x["critical_path"]
    t = Table(title=f"critical path ({len(path)} steps{', first 20' if len(path) > 20 else ''})",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("what", "kind", "start", "finish"):
        t.add_column(col, justify="left" if col in ("what", "kind") else "right", no_wrap=True)
    for p in path[:20]:
        t.add_row(p["what"], p["kind"], c(p["start"], "s"), c(p["finish"], "s"))
    out.print(t)
    if x["collectives"]:
        n = sum(k["count"] for k in x["collectives"])
        t = Table(title=f"collectives ({n}; count: one per independent set of devices)", box=box.SIMPLE_HEAD,
                  pad_edge=False)
        for col in ("tensor", "kind", "algorithm", "count", "ranks", "nodes", "buffer", "time"):
            t.add_column(col, justify="left" if col in ("tensor", "kind", "algorithm") else "right", no_wrap=True)
        for k in sorted(x["collectives"], key=lambda k: -k["seconds"])[:20]:
            t.add_row(k["tensor"], k["kind"], k["algorithm"], f"x{k['count']}", str(k["ranks"]), str(k["nodes"]),
                      c(k["bytes"], "B"), c(k["seconds"], "s"))
        out.print(t)


def _devices(ds: list[int]) -> str:
    """``0-7`` for runs, ``0,2,5`` otherwise."""
    if not ds:
        return "-"
    parts, start, prev = [], ds[0], ds[0]
    for d in ds[1:] + [None]:
        if d is not None and d == prev + 1:
            prev = d
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if d is not None:
            start = prev = d
    return ",".join(parts)


def eval_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    hardware: Annotated[str, typer.Option("--hardware", "-H",
                                          help="hardware preset (h100-sxm-8, h100-sxm-64, a100-sxm-64, b200-64, "
                                               "gb200-nvl72, ...: costmodel/presets.py) or a hardware YAML file")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
    explain: Annotated[bool, typer.Option("--explain", help="where the time goes: compute-, memory- or "
                                          "communication-bound ops, the critical path, the collectives")] = False,
    gantt: Annotated[Optional[str], typer.Option("--gantt", help="draw the simulated schedule per device to "
                                                 "this .png or .svg file")] = None,
    layers: Annotated[str, typer.Option("--layers", help="whole: simulate every layer; repeat: a model of "
                                        "repeated layers from two truncations, extended along its layers "
                                        "(fast for tens of layers on hundreds of GPUs; objectives only)")] = "whole",
) -> None:
    """Evaluate a plan: makespan, energy, memory, devices, bytes moved, the lower bound and gap,
    model FLOPs and MFU, and where the time goes per operation and per device."""
    if gantt is not None and not gantt.endswith((".png", ".svg")):
        raise UserError(f"--gantt {gantt}: the picture's file name must end in .png or .svg")
    if gantt is not None:
        check_output_path(gantt, "--gantt")
    if layers not in ("whole", "repeat"):
        raise UserError(f"--layers {layers}: expected 'whole' or 'repeat'")
    r = eval_report(plan, hardware, explain, gantt, layers)
    if as_json:
        print(json.dumps(r, indent=1))
    else:
        print_report(r)
