"""``tapestry calibrate`` (fit the cost model to this machine) and ``tapestry execute`` (run a plan
across Dask workers, one plan device per worker, and check it against the original)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from optimizer.cli.common import check_output_path, console, load_plan_document, reference_program
from optimizer.cli.errors import UserError


def _check_backend(backend: str) -> None:
    from executor.backend import BACKENDS, BackendError, get_backend

    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}")
    try:
        get_backend(backend)
    except BackendError:
        raise
    except Exception as e:  # noqa: BLE001  (a broken CuPy install: still a clear message, no traceback)
        raise BackendError(f"backend {backend!r} cannot start here: {type(e).__name__}: {e}; "
                           f"use --backend numpy") from None


def _si(x: float, unit: str) -> str:
    for f, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n")):
        if abs(x) >= f:
            return f"{x / f:.3g}{p}{unit}"
    return f"{x:.3g}{unit}"


def calibrate_cmd(
    backend: Annotated[str, typer.Option(help="numpy (this CPU) or cupy (this machine's GPU)")] = "numpy",
    hardware: Annotated[str, typer.Option(help="preset or hardware YAML to calibrate, e.g. cpu, h100-sxm-8")] = "",
    out: Annotated[str, typer.Option("--out", "-o", help="calibrated hardware file to write (.yaml)")] = "",
    quick: Annotated[bool, typer.Option(help="a few small points per kernel class (seconds, for smoke tests)")] = False,
    repeats: Annotated[int, typer.Option(help="timed runs per point (the median is kept)")] = 5,
    dtype: Annotated[Optional[list[str]], typer.Option(help="dtypes to time (repeatable); default float32")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="also write the points and fits as JSON")] = None,
) -> None:
    """Fit the cost model's efficiency factors to timings on this machine; write a hardware file.

    Times a spread of kernels and shard sizes (median of --repeats), fits the efficiency factors and launch overheads per kernel class, prints measured vs model before and after, and writes --out as the preset plus overrides; campaigns use it as 'hardware: FILE.yaml'.
    """
    from costmodel.hardware_io import load_hardware, save_hardware
    from costmodel.presets import PRESETS
    from optimizer.realrun.calibration import run_calibration

    if not hardware:
        raise UserError("calibrate needs --hardware: a preset (e.g. cpu for --backend numpy, h100-sxm-8 for cupy) "
                        "or a hardware YAML file")
    if not out:
        raise UserError("calibrate needs --out FILE.yaml: where to write the calibrated hardware")
    if not out.endswith((".yaml", ".yml")):
        raise UserError(f"--out {out!r} must end in .yaml or .yml")
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    check_output_path(out)
    if json_out:
        check_output_path(json_out, "--json")
    _check_backend(backend)
    base = load_hardware(hardware)
    dtypes = tuple(dtype or ("float32",))
    for d in dtypes:
        base.peak_flops(d)  # HardwareError names the known dtypes
    res = run_calibration(backend, base, quick=quick, repeats=repeats, dtypes=dtypes)
    path = save_hardware(res.hardware, out, base=hardware if hardware in PRESETS else None)
    _print_calibration(res, backend)
    if json_out:
        doc = {"backend": backend, "hardware": base.name, "out": str(path), "points": res.rows(),
               "factors": res.factors(), "error_before": res.before, "error_after": res.after}
        with open(check_output_path(json_out, "--json"), "w") as f:
            json.dump(doc, f, indent=1)
    console.print(f"wrote {path} (load it with --hardware {path}, or 'hardware: {path}' in a campaign)")


def _print_calibration(res, backend: str) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    out = console if console.is_terminal else Console(width=max(console.width, 130), highlight=False)
    t = Table(title=f"measured vs model ({backend}, {res.base.name})", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("case", "class", "FLOPs", "bytes", "measured", "model before", "ratio", "model after", "ratio "):
        t.add_column(col, justify="left" if col in ("case", "class") else "right")
    for r in res.rows():
        t.add_row(r["case"], r["kernel_class"], _si(r["flops"], ""), _si(r["bytes"], "B"), _si(r["measured"], "s"),
                  _si(r["model_before"], "s"), f"{r['model_before'] / r['measured']:.2f}", _si(r["model_after"], "s"),
                  f"{r['model_after'] / r['measured']:.2f}")
    out.print(t)
    f = Table(title="fitted factors per kernel class", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("class", "points", "compute eff", "memory eff", "launch", "fit rms rel err"):
        f.add_column(col, justify="left" if col == "class" else "right")
    for k, v in res.factors().items():
        f.add_row(k, str(v["n"]), f"{v['compute']:.3g}" + ("" if v["compute_identified"] else " (kept)"),
                  f"{v['memory']:.3g}" + ("" if v["memory_identified"] else " (kept)"),
                  _si(v["launch"], "s") + ("" if v.get("launch_identified", True) else " (kept)"),
                  "-" if v["rms_rel_error"] is None else f"{v['rms_rel_error']:.2f}")
    out.print(f)
    b, a = res.before, res.after
    out.print(f"model error over {b['n']} points, mean |log(model/measured)|: before {b['mean_abs_log']:.3f}, "
              f"after {a['mean_abs_log']:.3f}; median: before {b['median_abs_log']:.3f}, after {a['median_abs_log']:.3f}")


def execute_cmd(
    plan: Annotated[str, typer.Argument(help="plan file (JSON)")],
    scheduler: Annotated[Optional[str], typer.Option(help="Dask scheduler address (default: a local cluster)")] = None,
    workers: Annotated[Optional[int], typer.Option(help="local cluster workers (default: one per plan device, "
                                                        "at most the CPU count)")] = None,
    backend: Annotated[str, typer.Option(help="numpy or cupy (cupy: workers with --resources GPU=1)")] = "numpy",
    seed: Annotated[int, typer.Option(help="seed of the random inputs")] = 0,
    json_out: Annotated[Optional[str], typer.Option("--json", help="write the report as JSON")] = None,
    reference: Annotated[Optional[str], typer.Option(help="the program the plan must compute (a plan or program "
                                                     "file; its unsharded form is the reference)")] = None,
    db: Annotated[Optional[str], typer.Option(help="archive to find the plan's program in (by its digest)")] = None,
    self_check: Annotated[bool, typer.Option("--self-check", help="compare with the plan's own unsharded form: "
                                             "proves the sharding consistent, not the program")] = False,
) -> None:
    """Run a plan across Dask workers and compare its outputs with the program it derives from.

    Plan device i runs on worker i mod n; between workers move exactly the boxes of the cost model's
    transfers. The program is found as 'tapestry verify' finds it (--reference, the embedded
    program, --db, or --self-check). Exit status 0 on PASS, 1 on FAIL, 2 for bad input.
    """
    from executor.device_run import IncompleteCommunication
    from executor.verify import interface_problems
    from optimizer.campaign.cluster import grid_client
    from optimizer.realrun.grid import GridError, run_plan_on_grid

    if workers is not None and workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    if backend not in ("numpy", "cupy"):
        raise UserError(f"--backend {backend!r} is not one of numpy, cupy")
    if not scheduler:  # the local cluster runs here: CuPy and a GPU must be here too
        _check_backend(backend)
    if seed < 0:
        raise UserError(f"--seed must be >= 0, got {seed}")
    if json_out:
        check_output_path(json_out, "--json")
    g, prov = load_plan_document(plan)
    ref, how = reference_program(g, prov, reference, db, self_check)
    problems = interface_problems(g, ref)
    if problems:
        console.print(f"FAIL: the plan does not read and write the program's tensors: {'; '.join(problems)} "
                      f"[reference: {how}]", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    with grid_client(scheduler, workers, backend, n_devices=1 + max(g.devices, default=0)) as client:
        try:
            report = run_plan_on_grid(g, client, backend=backend, seed=seed, reference=ref)
        except GridError as e:
            raise UserError(str(e)) from None
        except IncompleteCommunication as e:
            console.print(f"FAIL: {e}")
            raise typer.Exit(1) from None
    console.print(f"{report} [reference: {how}]", markup=False, soft_wrap=True)
    if json_out:
        with open(check_output_path(json_out, "--json"), "w") as f:
            json.dump(report.to_json(), f, indent=1)
    if not report.ok:
        raise typer.Exit(1)
